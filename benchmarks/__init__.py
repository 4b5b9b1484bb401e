"""The benchmarks: scripts run as `python benchmarks/<name>.py` (each imports the suites' library,
benchmarks/bench, as `bench`: a script's own folder comes first on sys.path), and importable from
the repository root as `benchmarks.<name>` (the tests import `benchmarks.bench`)."""
