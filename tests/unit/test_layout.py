"""The package's shape: a regular package with a version, imports that point downwards only
(import-linter's contract in pyproject.toml, imports inside functions counted), no cycles."""

from __future__ import annotations

from pathlib import Path

import raytrain_cpu

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "raytrain_cpu"


def test_regular_package_with_version():
    assert raytrain_cpu.__file__ is not None  # not an implicit namespace package
    assert raytrain_cpu.__version__


def test_import_contracts_hold(monkeypatch, capsys):
    """`lint-imports` in-process, as CI would run it; its report is the failure message."""
    from importlinter.cli import lint_imports

    monkeypatch.chdir(ROOT)
    code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    assert code == 0, capsys.readouterr().out


def test_no_sys_path_games_in_the_package():
    """Nothing in the package edits sys.path to reach a source checkout (benchmarks included)."""
    offenders = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in PACKAGE.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "sys.path.insert" in line or "sys.path.append" in line
    ]
    assert not offenders, offenders
