"""Fast tests of raytrain_cpu.host (features, threads, memory, gemm) and obs.timing: feature parsing, placement arithmetic, dtype choice, MFU, timers.
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_cpu_e2e.py."""

from __future__ import annotations

import os
import shutil
import sys
import time

import pytest

from raytrain_cpu.host import features as host_features
from raytrain_cpu.host import gemm as host_gemm
from raytrain_cpu.host import memory as host_memory
from raytrain_cpu.host import threads as host_threads
from raytrain_cpu.model import shape as model_shape
from raytrain_cpu.obs import timing as obs_timing
from raytrain_cpu.trainer import setup as worker_setup


def _cpuinfo(sockets: int, cores: int, threads: int, flags: str) -> str:
    """A /proc/cpuinfo with Linux's numbering: vCPU n and n + sockets*cores are siblings."""
    blocks, n = [], 0
    for t in range(threads):
        for s in range(sockets):
            for c in range(cores):
                blocks.append(
                    f"processor\t: {n}\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon test\n"
                    f"physical id\t: {s}\ncore id\t\t: {c}\nflags\t\t: {flags}\n"
                )
                n += 1
        del t
    return "\n".join(blocks) + "\n"


C7I_FLAGS = "fpu sse avx2 fma avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8"


def test_parse_cpulist():
    assert host_features.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert host_features.parse_cpulist("") == []


def test_two_socket_hyperthreaded_node():
    """A c7i.48xlarge: 2 sockets x 48 cores x 2 threads, AMX."""
    first, cpus = host_features.parse_cpuinfo(_cpuinfo(2, 48, 2, C7I_FLAGS))
    numa = {0: [c for c, s, _ in cpus if s == 0], 1: [c for c, s, _ in cpus if s == 1]}
    f = host_features.summarize_topology(cpus, numa, first["flags"].split(), first["model name"], first["vendor_id"])
    assert (f.sockets, f.physical_cores, f.vcpus, f.threads_per_core, f.numa_nodes) == (2, 96, 192, 2, 2)
    assert f.flags["amx_bf16"] and f.flags["avx512_bf16"] and f.best_isa == "amx_bf16"
    assert f.cores[0] == [0, 0, 0, 96]  # socket 0, core 0, and its sibling vCPU 96
    assert "2 socket(s), 96 physical cores, 192 vCPUs" in f.describe()


def test_missing_topology_counts_every_vcpu_as_a_core():
    text = "processor\t: 0\nflags\t: avx2\n\nprocessor\t: 1\nflags\t: avx2\n"
    first, cpus = host_features.parse_cpuinfo(text)
    f = host_features.summarize_topology(cpus, {}, first["flags"].split())
    assert (f.physical_cores, f.vcpus, f.threads_per_core, f.best_isa) == (2, 2, 1, "avx2")


def test_cpu_flags_reads_every_flag_of_the_first_cpu(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(_cpuinfo(1, 2, 1, C7I_FLAGS + " avx512bw f16c"))
    assert host_features.cpu_flags(str(info)) >= {"amx_bf16", "avx512bw", "f16c"}  # beyond ISA_FLAGS too
    assert host_features.cpu_flags(str(tmp_path / "missing")) == set()


def test_this_machine_reads():
    f = host_features.cpu_features()
    assert f.vcpus >= f.physical_cores >= 1 and f.sockets >= 1 and f.allowed_cpus
    assert set(f.to_dict()) >= {"flags", "sockets", "physical_cores", "vcpus", "numa_nodes", "best_isa"}


@pytest.mark.parametrize(
    ("cpus", "tpc", "physical", "per_node", "expected"),
    [
        (0.5, 1, 2, 2, 1),  # this 2-core box, 2 workers: one thread each
        (184, 2, 96, 1, 92),  # c7i.48xlarge, one rank per node: physical cores, not vCPUs
        (95, 2, 96, 2, 47),  # one rank per socket
        (192, 2, 96, 2, 48),  # capped at the rank's share of the node
    ],
)
def test_threads_follow_physical_cores(cpus, tpc, physical, per_node, expected):
    assert host_threads.threads_per_worker(cpus, tpc, physical, per_node) == expected


def test_rank_cores_one_socket_per_rank():
    first, cpus = host_features.parse_cpuinfo(_cpuinfo(2, 4, 2, C7I_FLAGS))
    f = host_features.summarize_topology(cpus, {}, [])
    r0 = host_threads.rank_cores(f.cores, f.sockets, 0, 2, threads=3)
    r1 = host_threads.rank_cores(f.cores, f.sockets, 1, 2, threads=3)
    assert r0 == [0, 1, 2, 8, 9, 10]  # socket 0's first 3 cores with their siblings
    assert r1 == [4, 5, 6, 12, 13, 14]  # socket 1
    assert host_threads.default_workers_per_node(2) == 2 and host_threads.default_workers_per_node(1) == 1


def test_rank_cores_split_within_a_socket():
    cores = [[0, c, c] for c in range(4)]
    assert host_threads.rank_cores(cores, 1, 0, 2, threads=2) == [0, 1]
    assert host_threads.rank_cores(cores, 1, 1, 2, threads=2) == [2, 3]
    assert host_threads.rank_cores(cores[:1], 1, 1, 2, threads=1) == [0]  # more ranks than cores: share


def test_place_threads_sets_torch_threads_and_pins(monkeypatch):
    import os

    import torch

    before_threads, before_mask = torch.get_num_threads(), os.sched_getaffinity(0)
    try:
        out = host_threads.place_threads(1, 0, 1, pin=True)
        assert out["intra_op_threads"] == 1 and torch.get_num_threads() == 1
        assert out["pinned_cpus"] and set(out["pinned_cpus"]) <= before_mask
        assert os.sched_getaffinity(0) == set(out["pinned_cpus"])
    finally:
        torch.set_num_threads(before_threads)
        os.sched_setaffinity(0, before_mask)


@pytest.mark.parametrize(
    ("requested", "bf16", "fp32", "dtype"),
    [
        ("auto", 300e9, 100e9, "bf16"),  # AMX
        ("auto", 75e9, 120e9, "fp32"),  # AVX-512 BF16 through oneDNN, as measured on the dev box
        ("auto", 101e9, 100e9, "fp32"),  # within the margin: not worth bf16's rounding
        ("bf16", 75e9, 120e9, "bf16"),  # explicit wins, with a note
        ("fp32", 300e9, 100e9, "fp32"),
    ],
)
def test_decide_dtype(requested, bf16, fp32, dtype):
    got, reason = host_gemm.decide_dtype(requested, bf16, fp32)
    assert got == dtype
    assert ("slower" in reason) == (requested == "bf16" and bf16 < fp32)


def test_choose_dtype_agrees_across_ranks():
    gemms = model_shape.llama_gemms(64, 176, 4, 2, 2048, 2, tokens=64)
    seen = []

    def agree(values):
        seen.append(values)
        return [1.0, 2.0]  # whatever this rank measured, the group says fp32 is faster

    with pytest.warns(UserWarning, match="training in fp32"):
        out = host_gemm.choose_dtype("auto", gemms, agree, min_time_s=0.001)
    assert out["dtype"] == "fp32" and out["peak_flops_per_s"] == 2.0 and len(seen[0]) == 2


def test_mfu_peak_timed_again_in_the_chosen_dtype_and_agreed():
    """MFU's denominator (host_gemm.time_peak_flops): the probe's shapes in the dtype chosen, averaged
    over ranks by `agree`, which gets this rank's one rate."""
    gemms = model_shape.llama_gemms(64, 176, 4, 2, 2048, 2, tokens=64)
    seen = []

    def agree(values):
        seen.append(values)
        return [3.0e9]

    assert host_gemm.time_peak_flops(gemms, "fp32", agree) == 3.0e9
    assert len(seen[0]) == 1 and seen[0][0] > 0
    assert host_gemm.time_peak_flops(gemms, "bf16") > 0


def test_gemm_flops_match_6n():
    """Forward + both backward GEMMs of every weight = 6 x non-embedding params per token."""
    from benchmarks.bench.common import n_params

    shape = {"hidden_size": 512, "num_layers": 16, "num_heads": 8, "num_kv_heads": 8, "intermediate_size": 1408}
    tokens = 1024
    gemms = model_shape.llama_gemms(512, 1408, 8, 8, 2048, 16, tokens)
    total = sum(g.flops * g.count for g in gemms)
    p = n_params(shape)
    norms = 2 * 16 * 512 + 512  # norm weights are parameters but not GEMMs
    assert total == 6 * (p["non_embedding"] - norms) * tokens


def test_probe_subset_is_cheap():
    big = model_shape.llama_gemms(4096, 14336, 32, 8, 128256, 32, tokens=8192)
    small = host_gemm.probe_gemms(big)
    assert all(g.name.startswith("fwd") and g.m <= 1024 for g in small)
    assert not any("128256" in g.name for g in small)  # the vocabulary head would need GBs


def test_mfu_formula():
    """MFU = (6N + 12 L d seq) tokens/s / peak, N without the input embedding."""
    from benchmarks.bench.common import mfu_of, n_params
    from raytrain_cpu.obs.metrics import flops_per_token

    shape = {"hidden_size": 512, "num_layers": 16, "num_heads": 8, "num_kv_heads": 8, "intermediate_size": 1408}
    p = n_params(shape)
    assert p["total"] - p["non_embedding"] == 2048 * 512  # only the input embedding is left out
    fpt = flops_per_token(p, 512)
    assert fpt == 6 * p["non_embedding"] + 12 * 16 * 512 * 512
    assert mfu_of(200.0, p, 512, 100e9, world=2) == pytest.approx(200 * fpt / 200e9)


def test_n_params_matches_the_model_files(tmp_path):
    """bench.n_params (no files) = model.count_parameters (config.json) for the bench model."""
    import json

    from benchmarks.bench.common import n_params
    from raytrain_cpu.model.loading import count_parameters

    shape = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 176}
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 2048,
                "hidden_size": 64,
                "intermediate_size": 176,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "tie_word_embeddings": False,
            }
        )
    )
    assert count_parameters(str(tmp_path)) == n_params(shape)


def test_find_allocator(tmp_path):
    assert host_memory.find_allocator("system") == ("system", "")
    (tmp_path / "libtcmalloc.so.4").write_text("")
    name, path = host_memory.find_allocator("tcmalloc", search_dirs=[str(tmp_path)])
    assert name == "tcmalloc" and path == str(tmp_path / "libtcmalloc.so.4")
    (tmp_path / "libjemalloc.so.2").write_text("")
    assert host_memory.find_allocator("auto", search_dirs=[str(tmp_path)])[0] == "jemalloc"


def test_rays_jemalloc_serves_when_the_system_has_none(tmp_path, monkeypatch):
    """Ray's wheel ships a preloadable jemalloc: every install gets one without apt-get."""
    bundled = host_memory.bundled_jemalloc()
    assert bundled.endswith(os.path.join("ray", "core", "libjemalloc.so")) and os.path.isfile(bundled)
    monkeypatch.setattr(host_memory, "_LIB_DIRS", ())
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.delenv("CONDA_PREFIX", raising=False)
    assert host_memory.find_allocator("auto") == ("jemalloc", bundled)
    (tmp_path / "libjemalloc.so.2").write_text("")  # a system one comes first
    assert host_memory.find_allocator("auto", search_dirs=[str(tmp_path)]) == (
        "jemalloc",
        str(tmp_path / "libjemalloc.so.2"),
    )


def test_free_pages_released_past_the_limit_once_a_growth():
    """scaling.free_memory_growth_mib: the baseline is the resident memory after the first steps;
    growth past it by the limit releases (the real release: test above); a release that frees
    little raises the baseline, so live growth does not release every step; 0 never releases."""
    from raytrain_cpu.trainer.state import FreePages

    mib = 2**20
    calls = []

    def release_to(after):
        return lambda: calls.append(after) or after

    pages = FreePages(limit=100 * mib, first_step=3)
    assert pages.after_step(1, 900 * mib, release_to(0)) is None  # warm-up: no baseline yet
    assert pages.after_step(3, 500 * mib, release_to(0)) is None and pages.baseline == 500 * mib
    assert pages.after_step(4, 600 * mib, release_to(0)) is None  # at the limit, not past it
    assert pages.after_step(5, 650 * mib, release_to(520 * mib)) == 130 * mib  # freed pages went back
    assert (pages.releases, pages.baseline, pages.released) == (1, 520 * mib, 130 * mib)
    # live memory grew: the release frees little, the baseline moves up with it
    assert pages.after_step(6, 700 * mib, release_to(690 * mib)) == 10 * mib
    assert pages.baseline == 690 * mib
    assert pages.after_step(7, 780 * mib, release_to(0)) is None  # no release at every step now
    assert calls == [520 * mib, 690 * mib]
    off = FreePages(limit=0, first_step=3)
    assert all(off.after_step(s, s * 1000 * mib, release_to(0)) is None for s in range(10))


def test_allocator_in_use(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n")
    assert host_memory.allocator_in_use(str(maps)) == "jemalloc"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert host_memory.allocator_in_use(str(maps)) == "system"


def test_worker_env_turns_omp_binding_off_for_shared_nodes(monkeypatch):
    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.launch.sizing import worker_env

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    cfg = load_config(None, ["scaling.allocator=system", "scaling.glibc_mmap_threshold=0"])
    assert worker_env(cfg, 1) == {}
    assert worker_env(cfg, 2) == {"OMP_PROC_BIND": "false"}


def test_omp_wait_policy_reaches_the_workers_only_when_chosen(monkeypatch):
    from raytrain_cpu.config.schema import ConfigError, load_config
    from raytrain_cpu.launch.sizing import worker_env

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    base = ["scaling.allocator=system", "scaling.glibc_mmap_threshold=0"]
    assert "OMP_WAIT_POLICY" not in worker_env(load_config(None, base), 1)  # OpenMP's own
    cfg = load_config(None, [*base, "scaling.omp_wait_policy=active"])
    assert worker_env(cfg, 1) == {"OMP_WAIT_POLICY": "active"}
    with pytest.raises(ConfigError, match="scaling.omp_wait_policy"):
        load_config(None, [*base, "scaling.omp_wait_policy=spin"])


def test_glibc_workers_get_a_fixed_mmap_threshold_and_twice_it_to_trim(monkeypatch):
    """Without jemalloc/tcmalloc: 32 MiB by default (a kept heap), 1 MiB on request (less memory)."""
    from raytrain_cpu.config.schema import load_config
    from raytrain_cpu.launch.sizing import worker_env

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    default = load_config(None, ["scaling.allocator=system"])
    assert worker_env(default, 1) == {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 20)}
    cfg = load_config(None, ["scaling.allocator=system", f"scaling.glibc_mmap_threshold={1 << 20}"])
    assert worker_env(cfg, 1) == {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(2 << 20)}
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the user's own setting wins
    assert worker_env(cfg, 1)["MALLOC_MMAP_THRESHOLD_"] == "65536"
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setattr(host_memory, "find_allocator", lambda choice: ("jemalloc", "/x/libjemalloc.so.2"))
    assert "MALLOC_MMAP_THRESHOLD_" not in worker_env(load_config(None, []), 1)  # jemalloc has its own


def test_step_clock_skips_the_warmup_steps_and_sums_phases():
    comm = obs_timing.CommTimer()
    clock = obs_timing.StepClock(comm)
    assert clock.warmup == obs_timing.WARMUP_STEPS == 2
    for step in range(4):
        clock.start_step()
        clock.add("forward", 1.0 + step)
        clock.add("backward", 2.0)
        comm.seconds += 0.5
        clock.end_step()
    s = clock.summary()
    assert s["steps"] == 2 and s["forward_s"] == pytest.approx(3.5) and s["backward_s"] == 2.0
    assert s["comm_s"] == pytest.approx(0.5)
    assert obs_timing.StepClock().summary()["comm_s"] is None  # not measured, not zero
    one = obs_timing.StepClock(warmup=0)
    one.start_step(), one.add("forward", 1.0), one.end_step()
    assert one.summary()["steps"] == 1 and one.summary()["forward_s"] == 1.0


def test_step_clock_weighs_each_gemm_timing_by_its_steps_seconds(monkeypatch):
    """train.mfu_probe_every: MFU's denominator is the rate timed after each timed step, weighted
    by that step's seconds; a warm-up step's timing, and a second timing after one step, are left out."""
    now = [0.0]
    monkeypatch.setattr(obs_timing.time, "perf_counter", lambda: now[0])
    clock = obs_timing.StepClock(warmup=1)
    for seconds, rate in ((9.0, 1e12), (1.0, 100e9), (3.0, 200e9)):
        clock.start_step()
        now[0] += seconds
        clock.end_step()
        clock.peak(rate, rate / 2)
    clock.peak(5e12, 5e12)  # no step since the last timing
    s = clock.summary()
    assert s["peak_timings"] == 2 and s["peak_flops_per_s"] == pytest.approx((1.0 * 100e9 + 3.0 * 200e9) / 4.0)
    assert s["mean_gemm_flops_per_s"] == pytest.approx(s["peak_flops_per_s"] / 2)
    never = obs_timing.StepClock().summary()
    assert never["peak_flops_per_s"] is None and never["mean_gemm_flops_per_s"] is None  # never timed, not zero


def test_time_calls_keeps_the_best_batch_and_every_calls_mean(monkeypatch):
    """host_gemm.time_calls on a host that alternates fast and slow spells: the best batch reads the
    fast spell, the mean the host's average (what host_gemm.time_training_mix reports as `mean`)."""
    now, calls = [0.0], [0]

    def fn():
        calls[0] += 1
        now[0] += 0.01 if (calls[0] // 8) % 2 else 0.02  # spells of 8 calls: 10 ms or 20 ms

    monkeypatch.setattr(host_gemm.time, "perf_counter", lambda: now[0])
    best, mean = host_gemm.time_calls(fn, min_time_s=1.0, warmup=0)
    assert best == pytest.approx(0.01) and 0.012 < mean < 0.018


def test_training_mix_times_peak_and_mean_and_agrees_both():
    gemms = model_shape.llama_gemms(64, 176, 4, 2, 2048, 2, tokens=64)[:2]  # forward and input gradient
    seen = []

    def agree(values):
        seen.append(values)
        return [3.0e9, 2.0e9]

    assert host_gemm.time_training_mix(gemms, "fp32", agree) == (3.0e9, 2.0e9)
    peak, mean = seen[0]
    assert peak >= mean > 0


def test_comm_timer_counts_nested_calls_once():
    timer = obs_timing.CommTimer()
    inner = timer._timed(lambda: time.sleep(0.01))
    outer = timer._timed(lambda: inner())
    outer()
    assert timer.calls == 1 and 0.009 < timer.seconds < 0.5


def test_peak_rss_resets():
    assert host_memory.peak_rss_bytes() > 0
    if host_memory.reset_peak_rss():
        assert host_memory.peak_rss_bytes() > 0


def test_op_time_by_kind_sorts_a_real_profile():
    import torch
    from torch.profiler import profile

    a = torch.randn(512, 512)  # cat's time must survive op_time_by_kind's rounding to 0.1 ms
    t0 = time.perf_counter()
    with profile() as prof:
        for _ in range(3):
            torch.cat([(a @ a).relu_(), a])
    wall = time.perf_counter() - t0
    rows = {r["kind"]: r for r in obs_timing.op_time_by_kind(prof.key_averages(), wall)}
    assert rows["GEMM"]["seconds"] > 0 and rows["copies and casts"]["seconds"] > 0  # mm; cat
    assert rows["other operators"]["seconds"] > 0 and rows["collectives"]["seconds"] == 0  # relu_
    assert sum(r["seconds"] for r in rows.values()) == pytest.approx(wall, abs=1e-3)


def test_op_time_by_kind_counts_the_fused_kernel_as_attention():
    import torch
    from torch.profiler import profile

    from raytrain_cpu.model.ops import fused_attention

    if fused_attention.kernel() is None:
        pytest.skip(fused_attention.why_unavailable())
    q = torch.randn(1, 2, 128, 16, dtype=torch.bfloat16, requires_grad=True)
    with profile() as prof:
        fused_attention.fused_causal(q, q, q).sum().backward()
    rows = {r["kind"]: r["seconds"] for r in obs_timing.op_time_by_kind(prof.events(), 1.0)}
    own = sum(e.self_cpu_time_total for e in prof.events() if "fused_causal" in e.name) / 1e6
    assert own > 0 and rows["attention"] >= own - 1e-4  # the table rounds to 0.1 ms


def test_op_time_by_kind_counts_what_the_causal_blocks_run_as_attention():
    import torch
    from torch.profiler import profile

    from raytrain_cpu.model.ops.attention import causal_blocks

    q = torch.randn(1, 2, 128, 16, requires_grad=True)
    a = torch.randn(128, 128)
    with profile() as prof:
        causal_blocks(q, q, q).sum().backward()
        a @ a
    events = prof.events()
    rows = {r["kind"]: r["seconds"] for r in obs_timing.op_time_by_kind(events, 1.0)}
    own = sum(e.self_cpu_time_total for e in events if "causal_blocks" in e.name) / 1e6
    mm = sum(e.self_cpu_time_total for e in events if e.name == "aten::mm") / 1e6
    # Its bmm calls and softmax (forward and backward) count as attention; the plain mm stays a GEMM.
    assert rows["attention"] > own + 1e-4
    assert rows["GEMM"] == pytest.approx(mm, abs=1.5e-4)


def test_usable_cores_follow_the_affinity_mask():
    """Under taskset (or a cpuset) only the cores with an allowed vCPU count, siblings once."""
    first, cpus = host_features.parse_cpuinfo(_cpuinfo(1, 8, 2, C7I_FLAGS))
    f = host_features.summarize_topology(cpus, {}, first["flags"].split())
    assert f.usable_cores == 8  # no mask read: every core
    f.allowed_cpus = [0, 8, 1]  # core 0 and its sibling, and core 1
    assert f.usable_cores == 2
    f.allowed_cpus = list(range(16))
    assert f.usable_cores == 8


def test_affinity_cpus_sees_taskset(one_vcpu):
    """Under a mask of one vCPU: that is what this process may use, not the machine."""
    assert host_threads.affinity_cpus() == 1
    assert host_features.cpu_features().usable_cores == 1


@pytest.mark.parametrize(
    "params, dtype, span, compiler, compiled, why_not",
    [
        (400_000, "bf16", "block", "/usr/bin/g++", False, ""),  # the embedded default: it costs more than it saves
        (53_000_000, "bf16", "block", "/usr/bin/g++", True, ""),
        (53_000_000, "fp32", "block", "/usr/bin/g++", False, "training in fp32"),
        (53_000_000, "bf16", "document", "/usr/bin/g++", False, "document masks"),
        (53_000_000, "bf16", "block", "", False, "no C++ compiler for inductor"),
    ],
)
def test_compile_auto_compiles_where_it_pays(params, dtype, span, compiler, compiled, why_not):
    """model.compile=auto: a model of 20M parameters and more, in bf16, without document masks,
    where inductor finds its C++ compiler; the reason it does not where only that stands in the way."""
    on, reason = worker_setup.compile_auto(params, dtype, span, compiler)
    assert on is compiled and reason.startswith(why_not) and bool(reason) == bool(why_not)


def test_cpp_compiler_is_inductors(monkeypatch):
    """$CXX, else g++, as torch._inductor looks for it; '' where that is not on PATH."""
    monkeypatch.setenv("CXX", "no-such-compiler++")
    assert host_features.cpp_compiler() == ""
    monkeypatch.delenv("CXX")
    assert host_features.cpp_compiler() == (shutil.which("g++") or "")
