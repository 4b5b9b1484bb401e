"""`python -m raytrain_cpu.report`: kept as an entry point; the code lives in raytrain_cpu.obs.report
(also `raytrain-cpu` with a verb)."""

from raytrain_cpu.obs.report import main

if __name__ == "__main__":
    raise SystemExit(main())
