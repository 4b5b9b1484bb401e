"""`python -m raytrain_cpu.main`: kept as an entry point; the code lives in raytrain_cpu.launch.driver
(also `raytrain-cpu` with a verb)."""

from raytrain_cpu.launch.driver import main

if __name__ == "__main__":
    raise SystemExit(main())
