"""numpy internals the project names, each where numpy offers no public route."""

from __future__ import annotations

from raytrain_cpu.compat import written_for

written_for(__name__, "numpy", "2")

ARRAY_PICKLE_NAMES = frozenset(
    {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "_reconstruct"),
    }
)
"""The (module, name) pairs a plain pickle of a numpy array names: `_reconstruct` rebuilds it,
under numpy 2's module name and numpy 1's (the pickle keeps the name of the numpy that wrote it)."""
