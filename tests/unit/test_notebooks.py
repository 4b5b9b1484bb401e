"""The notebooks in notebooks/ are stored without outputs and run top to bottom without error.

Each is executed in memory with nbclient (the files are never rewritten); the cell tagged
"parameters" is replaced to point the notebook at temporary directories, papermill-style.
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_notebooks_e2e.py."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]


NOTEBOOKS = ROOT / "notebooks"


NAMES = ["memory_planning", "quickstart", "run_analysis"]


@pytest.mark.parametrize("name", NAMES)
def test_notebooks_are_stored_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: strip outputs before committing"
