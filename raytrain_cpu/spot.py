"""`python -m raytrain_cpu.spot`: kept as an entry point; the code lives in raytrain_cpu.launch.spot
(also `raytrain-cpu` with a verb)."""

from raytrain_cpu.launch.spot import main

if __name__ == "__main__":
    raise SystemExit(main())
