"""`python -m raytrain_cpu.plan`: kept as an entry point; the code lives in raytrain_cpu.planner.cli
(also `raytrain-cpu` with a verb)."""

from raytrain_cpu.planner.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
