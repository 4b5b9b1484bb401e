"""`python -m raytrain_cpu.export`: kept as an entry point; the code lives in raytrain_cpu.model.export
(also `raytrain-cpu` with a verb)."""

from raytrain_cpu.model.export import main

if __name__ == "__main__":
    raise SystemExit(main())
