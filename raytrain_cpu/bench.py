"""`python -m raytrain_cpu.bench <suite> ...`: runs benchmarks/suites.py of the source checkout
this package is installed from. The benchmarks are no part of the installed package."""

from __future__ import annotations

import os
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "suites.py"


def main(argv: list[str] | None = None) -> int:
    if not SCRIPT.is_file():
        print(
            f"error: no {SCRIPT}: the benchmarks live in the project's source checkout, not in the installed "
            "package; clone the repository, `pip install -e .` there and run `python benchmarks/suites.py <suite>`",
            file=sys.stderr,
        )
        return 2
    args = sys.argv[1:] if argv is None else list(argv)
    os.execv(sys.executable, [sys.executable, str(SCRIPT), *args])  # the script's folder on sys.path, as run by hand


if __name__ == "__main__":
    raise SystemExit(main())
