"""`python -m raytrain_cpu.data prepare ...`: see raytrain_cpu.data.prepare."""

from raytrain_cpu.data.prepare import main

if __name__ == "__main__":
    raise SystemExit(main())
