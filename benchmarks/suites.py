"""`python benchmarks/suites.py <suite> [--size 50m|tiny] [options] [key=value ...]`: the CPU
benchmark suites (gemm, train, load, scaling, placement, options, seed, lora, dpo, reference,
all). What each measures, and the options: benchmarks/bench/__init__.py, or --help."""

from bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
