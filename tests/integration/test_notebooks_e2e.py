"""The notebooks in notebooks/ are stored without outputs and run top to bottom without error.

Each is executed in memory with nbclient (the files are never rewritten); the cell tagged
"parameters" is replaced to point the notebook at temporary directories, papermill-style.
This module's in-process tests: tests/unit/test_notebooks.py."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]


NOTEBOOKS = ROOT / "notebooks"


def execute(name: str, cwd: Path, parameters: str | None = None, timeout: int = 300) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    if parameters is not None:
        (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        cell.source = parameters
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def outputs_text(nb: nbformat.NotebookNode) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", ""))
            parts.append(str(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def count_images(nb: nbformat.NotebookNode) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", []))


def test_memory_planning_notebook(tmp_path):
    nb = execute("memory_planning", tmp_path)
    text = outputs_text(nb)
    assert "estimates from raytrain_cpu.plan" in text
    assert "Llama-3-70B" in text and "70." in text  # the parameter count line
    assert count_images(nb) >= 3  # memory per model, communication, component breakdown


@pytest.fixture(scope="module")
def quickstart(ray_session, shared_cache, tmp_path_factory) -> tuple[nbformat.NotebookNode, Path]:
    """Runs the quickstart notebook once; its kernel joins the test session's Ray (RAY_ADDRESS)."""
    storage = tmp_path_factory.mktemp("quickstart")
    params = f'STORAGE = "{storage}"\nCACHE_DIR = "{shared_cache}"\nMAX_STEPS = 8'
    nb = execute("quickstart", storage, params, timeout=600)
    return nb, storage / "quickstart"


@pytest.mark.slow
def test_quickstart_notebook_trains_and_reports(quickstart):
    nb, run_dir = quickstart
    assert (run_dir / "summary.json").is_file() and (run_dir / "report.md").is_file()
    assert "raytrain_cpu summary" in outputs_text(nb)
    assert count_images(nb) == 3


@pytest.mark.slow
def test_run_analysis_notebook_on_the_quickstart_run(quickstart, tmp_path):
    _, run_dir = quickstart
    nb = execute("run_analysis", tmp_path, f'RUN_DIR = "{run_dir}"\nSMOOTHING = 3')
    text = outputs_text(nb)
    assert "tokens_per_s" in text and "finished" in text
    assert count_images(nb) == 2
