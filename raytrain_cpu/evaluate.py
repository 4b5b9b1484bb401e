"""`python -m raytrain_cpu.evaluate`: kept as an entry point; the code lives in raytrain_cpu.launch.evaluate
(also `raytrain-cpu` with a verb)."""

from raytrain_cpu.launch.evaluate import main

if __name__ == "__main__":
    raise SystemExit(main())
