"""model.weight_grad_kernel (raytrain_cpu.model.ops.linear): the kernel's weight gradient against fp32 at
ragged sizes and at several threads, the same forward and input-gradient bits as autograd's
linear, compiled too, installed only on bf16 linear layers that train, and 'auto' deciding by
a timing at the run's own threads."""

from __future__ import annotations

import copy

import pytest
import torch
from aten_threads import aten_threads
from helpers import forward_backward

from raytrain_cpu.model.ops import linear


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    if linear.kernel() is None:
        pytest.skip(f"the weight-gradient kernel is unavailable here: {linear.why_unavailable()}")


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).abs().max() / ref.abs().max())


# Full chunks of 512 tokens and ragged ones (odd counts too: VNNI pairs rows), output rows off
# the 64-row block, widths off the micro-kernel's 16/32.
@pytest.mark.parametrize(("tokens", "out", "inp"), [(1024, 128, 64), (513, 130, 96), (7, 3, 5), (600, 64, 176)])
def test_weight_grad_matches_fp32_at_ragged_sizes(tokens, out, inp):
    g = torch.Generator().manual_seed(tokens)
    dy = torch.randn(tokens, out, generator=g).to(torch.bfloat16)
    x = torch.randn(tokens, inp, generator=g).to(torch.bfloat16)
    got = linear.weight_grad(dy, x)
    assert got.dtype == torch.bfloat16 and got.shape == (out, inp)
    assert _rel_err(got, dy.float().t() @ x.float()) < 0.01  # bf16 rounding of the result: ~0.003


# At 2 and 4 threads: output rows enough for a task a thread per 64-row block (3,000 x 8 blocks
# at 2), and too few, where each block's columns split among tasks too (130 x 3 blocks: dy's
# transposes shared; 64 x 1 block; an odd chunk and widths off the 32-column step).
@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize(("tokens", "out", "inp"), [(1100, 512, 96), (513, 130, 200), (600, 64, 176), (7, 3, 5)])
def test_weight_grad_at_several_threads_matches_fp32(threads, tokens, out, inp):
    g = torch.Generator().manual_seed(tokens)
    dy = torch.randn(tokens, out, generator=g).to(torch.bfloat16)
    x = torch.randn(tokens, inp, generator=g).to(torch.bfloat16)
    with aten_threads(threads):
        got = linear.weight_grad(dy, x)
    assert got.shape == (out, inp)
    assert _rel_err(got, dy.float().t() @ x.float()) < 0.01


def _pair(bias: bool):
    torch.manual_seed(0)
    ref = torch.nn.Linear(96, 130, bias=bias).to(torch.bfloat16)
    ours = copy.deepcopy(ref)
    assert linear.install(ours) == 1
    return ref, ours


@pytest.mark.parametrize("bias", [True, False])
def test_same_forward_and_input_gradient_as_autograd_and_its_weight_gradient_within_rounding(bias):
    ref, ours = _pair(bias)
    x = torch.randn(3, 171, 96).to(torch.bfloat16)
    g = torch.randn(3, 171, 130).to(torch.bfloat16)
    (y_r, dx_r, dw_r, *db_r), (y, dx, dw, *db) = forward_backward(ref, x, g), forward_backward(ours, x, g)
    assert torch.equal(y, y_r) and torch.equal(dx, dx_r)
    assert _rel_err(dw, dw_r.float()) < 0.01
    assert len(db) == len(db_r) == int(bias) and all(_rel_err(a, b.float()) < 0.01 for a, b in zip(db, db_r))


def test_compiled_as_eager():
    _, ours = _pair(True)
    x = torch.randn(2, 64, 96).to(torch.bfloat16)
    g = torch.randn(2, 64, 130).to(torch.bfloat16)
    eager = forward_backward(ours, x, g)
    compiled = forward_backward(torch.compile(ours), x, g)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


def test_installed_on_trained_bf16_linears_only():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.model.layers[1].mlp.requires_grad_(False)  # frozen, as LoRA's base layers are
    assert linear.install(model) == 2 * 7 + 1 - 3  # q, k, v, o, gate, up, down a layer, the head
    assert linear.install(LlamaForCausalLM(cfg)) == 0  # fp32
    assert linear.install(model) == 0  # installed already: each forward is replaced once
    lin = torch.nn.Linear(4, 4).to(torch.bfloat16)
    linear.install(lin)
    with torch.no_grad():  # no autograd: the forward still answers
        assert lin(torch.randn(2, 4).to(torch.bfloat16)).shape == (2, 4)


def test_the_profile_table_counts_the_kernel_as_gemm():
    from torch.profiler import profile

    from raytrain_cpu.obs import timing as obs_timing

    dy, x = torch.randn(2048, 256).to(torch.bfloat16), torch.randn(2048, 256).to(torch.bfloat16)
    with profile() as prof:
        linear.weight_grad(dy, x)
    rows = {r["kind"]: r["seconds"] for r in obs_timing.op_time_by_kind(prof.events(), 1.0)}
    own = sum(e.self_cpu_time_total for e in prof.events() if e.name == "raytrain::weight_grad") / 1e6
    assert own > 0 and rows["GEMM"] >= own - 1e-4  # the table rounds to 0.1 ms


def _auto(monkeypatch, timings: dict[str, float] | None, amx: bool = True, n_params: int = 50_000_000, **kw):
    """linear.choose('auto') on a host with or without AMX, the timing replaced by `timings`
    (None: fails if called); returns (the choice, what reached `agree`)."""
    from raytrain_cpu.host import features as host_features

    monkeypatch.setattr(host_features, "cpu_flags", lambda: {"amx_bf16"} if amx else {"avx512f"})

    def timed(shapes, tokens):
        assert timings is not None, "timed where the gates should have stopped it"
        assert shapes == {(130, 96): 2} and tokens == 4096
        return timings

    monkeypatch.setattr(linear, "time_weight_grads", timed)
    agreed: list[list[float]] = []

    def agree(values):
        agreed.append(values)
        return values

    choice = linear.choose(kw.get("setting", "auto"), kw.get("dtype", "bf16"), n_params, {(130, 96): 2}, 4096, agree)
    return choice, agreed


def test_auto_takes_the_kernel_only_where_it_times_faster_by_the_margin_at_the_runs_threads(monkeypatch):
    with aten_threads(2):
        won, agreed = _auto(monkeypatch, {"kernel": 0.010, "autograd": 0.012})
    assert won.on and won.timings == {"kernel": 0.010, "autograd": 0.012} and won.threads == 2
    assert agreed == [[0.0, 0.010, 0.012]]  # the ranks' mean decides: every rank the same pick
    tie, _ = _auto(monkeypatch, {"kernel": 0.0097, "autograd": 0.010})
    assert not tie.on and "taken above 1.05x" in tie.why and tie.timings
    lost, _ = _auto(monkeypatch, {"kernel": 0.02, "autograd": 0.01})
    assert not lost.on and "0.50x" in lost.why


def test_auto_times_nothing_on_a_small_model_or_in_fp32_and_explicit_settings_are_kept(monkeypatch):
    small, agreed = _auto(monkeypatch, None, n_params=1_000_000)
    assert (small.on, small.why, agreed) == (False, "", [])
    fp32, agreed = _auto(monkeypatch, None, dtype="fp32")
    assert not fp32.on and agreed == []
    forced, agreed = _auto(monkeypatch, None, amx=False, setting=True)
    assert forced.on and agreed == [] and forced.timings == {}


def test_a_host_without_amx_still_joins_the_ranks_agreement_and_leaves_it_off(monkeypatch):
    """A rank past the size and dtype gates calls `agree` even where its host cannot run the
    kernel: the others' all-reduce would wait for it otherwise; any such rank turns it off."""
    choice, agreed = _auto(monkeypatch, None, amx=False)
    assert not choice.on and "no AMX" in choice.why and agreed == [[1.0, 0.0, 0.0]]


def test_the_timing_runs_both_at_the_models_shapes_and_finds_the_layers_install_takes():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.model.layers[1].mlp.requires_grad_(False)
    shapes = linear.linear_shapes(model)
    assert shapes == {(32, 32): 8, (80, 32): 2, (32, 80): 1, (64, 32): 1}
    assert sum(shapes.values()) == linear.install(model)
    with aten_threads(2):
        timings = linear.time_weight_grads({(80, 32): 2}, 600, reps=1)
    assert set(timings) == {"kernel", "autograd"} and all(0 < t < 1 for t in timings.values())
