"""Every use of a dependency's private internals, in one place.

Each module here is about one dependency (ray.py, deepspeed.py, transformers.py, torch.py, ...)
and declares the versions it was written for with `written_for(...)` at import. An upgrade past
them fails at import with an error naming the module, the versions and what to do, instead of
breaking silently at the internal it reaches into. Code outside this package uses only the
dependencies' public APIs (a test scans for it).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


class CompatError(RuntimeError):
    """An installed dependency is not a version a compat module was written for."""


def _matches(installed: str, spec: str) -> bool:
    """`spec` is a version prefix: "2.60" matches 2.60.0 and 2.60.1, not 2.61.0."""
    want = spec.split(".")
    return installed.split("+")[0].split(".")[: len(want)] == want


def written_for(module: str, package: str, *specs: str) -> str:
    """Checks that `package` is installed at one of the version prefixes `specs`; returns its
    version. Called at import by each compat module, once per dependency it reaches into."""
    try:
        installed = version(package)
    except PackageNotFoundError:
        raise CompatError(f"{module} needs {package} ({' or '.join(specs)}), which is not installed.") from None
    if not any(_matches(installed, s) for s in specs):
        raise CompatError(
            f"{module} reaches into {package}'s internals and was written for {package} "
            f"{' or '.join(s + '.*' for s in specs)}; {installed} is installed. Install the pinned version "
            f"(pip install -e . reinstalls the project's pins), or check each use in {module} against "
            f"{package} {installed} and add its version to the written_for call there."
        )
    return installed
