"""`python -m raytrain_cpu.generate`: kept as an entry point; the code lives in raytrain_cpu.model.generate
(also `raytrain-cpu` with a verb)."""

from raytrain_cpu.model.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
