"""`python -m raytrain_cpu.data prepare ...`: see raytrain_cpu.data.cli."""

from raytrain_cpu.data.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
