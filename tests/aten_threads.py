"""A helper for the kernels' tests: code run at a rank's many ATen threads, in small."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def aten_threads(n: int) -> Iterator[None]:
    """ATen (and the kernels' at::parallel_for) at `n` threads inside, the caller's count after.
    Ranks run 16-92; 2 or more is where a kernel's split of work among threads shows."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
