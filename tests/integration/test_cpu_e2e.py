"""Tests of raytrain_cpu.host (features, threads, memory, gemm) and obs.timing: feature parsing, placement arithmetic, dtype choice, MFU, timers.
This module's in-process tests: tests/unit/test_cpu.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from raytrain_cpu.host import memory as host_memory

# 256 MiB in 4 MiB tensors, each with a 256 KiB one made after it and kept (so glibc cannot
# trim the freed ones off its heap's top by itself); the RSS before and after release_free_memory.
_FREED_PAGES = """
import torch
from raytrain_cpu.host import memory as host_memory
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
xs, kept = [], []
for _ in range(64):
    xs.append(torch.ones(1 << 20))
    kept.append(torch.ones(1 << 16))
del xs
before = rss()
print(host_memory.allocator_in_use(), host_memory.release_free_memory(), before, rss(), sep="|")
"""


@pytest.mark.parametrize("allocator", ["jemalloc", "system"])
def test_release_free_memory_hands_the_freed_pages_back(allocator):
    """The workers' malloc settings keep freed pages for the next step; a phase end returns them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(host_memory.preload_env(allocator))
    out = subprocess.run([sys.executable, "-c", _FREED_PAGES], env=env, capture_output=True, text=True, check=True)
    in_use, how, before, after = out.stdout.strip().split("|")
    assert (in_use, how) == (allocator, {"jemalloc": "jemalloc purge", "system": "malloc_trim"}[allocator])
    assert int(before) - int(after) > 200 << 20, out.stdout
