"""The step-time and cost model (planner.steptime, planner.compare): its arithmetic by hand."""

from __future__ import annotations

import json

import pytest

from raytrain_cpu.planner.cli import main as plan_main
from raytrain_cpu.planner.comm import backward_regather_share
from raytrain_cpu.planner.compare import rank_threads
from raytrain_cpu.planner.plan import plan
from raytrain_cpu.planner.steptime import (
    GBIT,
    Collective,
    Rates,
    Topology,
    gemm_flops_per_rank,
    step_collectives,
    step_time,
)
from raytrain_cpu.planner.tables import KNOWN_SHAPES, on_demand_usd_per_hour

LLAMA3_8B = KNOWN_SHAPES["meta-llama/meta-llama-3-8b"]


def rates(**kw) -> Rates:
    base = dict(
        source="test",
        threads=1,
        gemm_flops_per_s=1e12,
        non_gemm_share=0.0,
        optimizer_s_per_param=0.0,
        shm_bytes_per_s=10e9,
        loopback_bytes_per_s=5e9,
        flow_bytes_per_s=10 * GBIT,
        nic_bytes_per_s=50 * GBIT,
    )
    return Rates(**(base | kw))


def test_a_ring_moves_all_but_its_own_share_over_each_link():
    assert Collective("gather", 4, 1000.0, 2).link_bytes() == pytest.approx(2 * 750.0)
    assert Collective("reduce", 4, 1000.0, 1, all_reduce=True).link_bytes() == pytest.approx(1500.0)
    assert Collective("gather", 1, 1000.0, 2).link_bytes() == 0.0


def test_one_flow_between_nodes_sets_the_pace_not_the_nodes_network():
    r = rates(loopback_bytes_per_s=20e9)
    assert r.link_bytes_per_s(crosses_nodes=True, shm=False) == 10 * GBIT  # the 10 Gbit/s flow, not 50
    assert r.link_bytes_per_s(True, False, flows=4) == 40 * GBIT  # striped over 4 groups
    assert r.link_bytes_per_s(True, False, flows=8) == 50 * GBIT  # the node's network
    assert r.link_bytes_per_s(False, shm=True) == 10e9 and r.link_bytes_per_s(False, shm=False) == 20e9
    assert rates(loopback_bytes_per_s=1e9).link_bytes_per_s(True, False) == 1e9  # the ring's in-node links


def test_flat_zero3_gathers_every_micro_batch_across_nodes_and_hpz_once_a_step():
    topo = Topology(8, 2)
    flat = step_collectives(LLAMA3_8B, topo, 3, grad_accum_steps=4)
    hpz = step_collectives(LLAMA3_8B, Topology(8, 2, hpz=2), 3, grad_accum_steps=4)
    crossing = lambda cs, kind: sum(c.count for c in cs if c.kind == kind and topo.spans_nodes(c.group))  # noqa: E731
    per_micro = 1 + backward_regather_share(LLAMA3_8B.num_params)  # forward, and most of it again in backward
    assert crossing(flat, "gather") == pytest.approx(4 * per_micro, rel=1e-4) and crossing(hpz, "gather") == 1
    assert crossing(flat, "reduce") == crossing(hpz, "reduce") == 4  # the gradients cross either way
    in_node = sum(c.count for c in hpz if c.kind == "gather" and c.group == 2)
    assert in_node == pytest.approx(4 * per_micro - 1, rel=1e-4)  # the rest stay in the node


def test_a_lora_base_under_hpz_never_crosses_nodes_after_its_first_step():
    topo = Topology(8, 2, hpz=2)
    colls = step_collectives(LLAMA3_8B, topo, 3, lora_rank=16)
    lora_params = LLAMA3_8B.lora_params(16)
    crossing = sum(c.payload * c.count for c in colls if c.kind == "gather" and topo.spans_nodes(c.group))
    assert crossing <= 2 * lora_params  # only the adapters' first gather (bf16)


def test_one_node_uses_shared_memory_and_nothing_crosses_a_network():
    s = step_time(LLAMA3_8B, Topology(2, 2), rates(), micro_batch=1, seq_len=128)
    assert s["comm_network_s"] == 0.0 and s["network_gib_per_step"] == 0.0
    assert s["comm_in_node_s"] == pytest.approx(s["comm_s"])


def test_compute_is_gemm_flops_over_the_rate_grown_by_the_non_gemm_share():
    r = rates(non_gemm_share=0.25)
    s = step_time(LLAMA3_8B, Topology(1), r, micro_batch=2, seq_len=512)
    flops = gemm_flops_per_rank(LLAMA3_8B, 1024, activation_checkpointing=False)
    assert s["compute_s"] == pytest.approx(flops / 1e12 / 0.75)
    assert gemm_flops_per_rank(LLAMA3_8B, 1024, False, lora=True) == pytest.approx(flops * 4 / 6)
    assert gemm_flops_per_rank(LLAMA3_8B, 1024, True) == pytest.approx(flops * 8 / 6)


def test_gloo_gathers_may_hide_behind_compute_but_shared_memory_ones_do_not():
    hidden = step_time(LLAMA3_8B, Topology(4, 2), rates(gather_overlap=1.0), micro_batch=1, seq_len=256)
    assert hidden["comm_exposed_s"] == pytest.approx(
        hidden["comm_s"] - min(hidden["comm_by_kind_s"]["gather"], hidden["compute_s"])
    )
    local = step_time(LLAMA3_8B, Topology(2, 2), rates(gather_overlap=1.0), micro_batch=1, seq_len=256)
    assert local["comm_exposed_s"] == pytest.approx(local["comm_s"])


def test_a_million_tokens_cost_the_nodes_hours_over_the_tokens():
    s = step_time(LLAMA3_8B, Topology(8, 2), rates(), micro_batch=8, seq_len=1024, instance="c7i.48xlarge")
    tokens = 8 * 1024 * 8
    assert s["usd_per_million_tokens"] == pytest.approx(8.568 * 4 * s["step_time_s"] / 3600 / tokens * 1e6)
    assert s["tokens_per_s"] == pytest.approx(tokens / s["step_time_s"])


def test_prices_and_threads_per_size():
    assert on_demand_usd_per_hour("c7i.48xlarge") == pytest.approx(8.568)
    assert on_demand_usd_per_hour("c7i.8xlarge") == pytest.approx(1.428)
    assert on_demand_usd_per_hour("r7i.8xlarge") > on_demand_usd_per_hour("m7i.8xlarge") > 1.428
    with pytest.raises(ValueError, match="no price"):
        on_demand_usd_per_hour("c6i.8xlarge")
    assert rank_threads("c7i.48xlarge", 2) == 48 and rank_threads("c7i.8xlarge", 1) == 16


def test_plan_reports_the_step_and_compares_variants_by_time_and_cost():
    r = plan(
        LLAMA3_8B,
        8,
        micro_batch=8,
        seq_len=1024,
        activation_checkpointing=True,
        ranks_per_node=2,
        instance="c7i.48xlarge",
    )
    for key in ("step_time_s", "tokens_per_s", "comm_exposed_s", "usd_per_million_tokens"):
        assert r[key] > 0
    names = {v["variant"] for v in r["variants_compared"]}
    assert {"zero3", "zero3_in_node", "zero2", "lora_r16"} <= names
    best = r["recommended_by_time"]
    assert best["fits"] and best["same_training"]
    fits = [v for v in r["variants_compared"] if v["fits"] and v["same_training"]]
    assert best["step_time_s"] == min(v["step_time_s"] for v in fits)
    assert r["recommended_by_cost"]["usd_per_million_tokens"] == min(v["usd_per_million_tokens"] for v in fits)


def test_hpz_holds_a_secondary_copy_per_rank():
    flat = plan(LLAMA3_8B, 8, ranks_per_node=2)
    hpz = plan(LLAMA3_8B, 8, ranks_per_node=2, hpz_partition_size=2)
    assert flat["components_gib"]["hpz_secondary"] == 0.0
    assert hpz["components_gib"]["hpz_secondary"] == pytest.approx(2 * LLAMA3_8B.num_params / 2 / 2**30, rel=0.01)
    assert (
        plan(LLAMA3_8B, 8, ranks_per_node=2, hpz_partition_size=0)["components_gib"]["hpz_secondary"] > 0
    )  # 0: a node's


def test_plan_cli_json_and_its_price_flags(capsys):
    assert (
        plan_main(
            [
                "--model",
                "tiny",
                "-w",
                "4",
                "--ranks-per-node",
                "2",
                "--instance",
                "c7i.48xlarge",
                "--usd-per-hour",
                "4",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["step"]["usd_per_node_hour"] == 4
    assert plan_main(["--model", "tiny", "--usd-per-hour", "0"]) == 2
    assert "--usd-per-hour must be > 0" in capsys.readouterr().err


def test_striping_crosses_nodes_on_more_flows_and_gloo_reduce_scatters_as_all_reduces():
    from raytrain_cpu.planner.compare import STRIPES
    from raytrain_cpu.trainer.collectives import DEFAULT_STRIPES

    assert STRIPES == DEFAULT_STRIPES
    r = rates(loopback_bytes_per_s=100e9)
    run = dict(micro_batch=8, seq_len=1024)
    one = step_time(LLAMA3_8B, Topology(8, 2), r, **run)
    four = step_time(LLAMA3_8B, Topology(8, 2, stripes=4), r, **run)
    assert four["comm_network_s"] == pytest.approx(one["comm_network_s"] / 4)
    # gloo's reduce_scatter_tensor sends an all-reduce's bytes: twice the gradient ring's
    g = LLAMA3_8B.num_params * 2 * 7 / 8
    assert one["comm_by_kind_s"]["reduce"] == pytest.approx(2 * g / (10 * GBIT))
    local = step_time(LLAMA3_8B, Topology(2, 2), r, **run)  # the shared-memory one does not
    assert local["comm_by_kind_s"]["reduce"] == pytest.approx(LLAMA3_8B.num_params * 2 / 2 / 10e9)


def test_the_comparison_offers_striping_only_across_nodes():
    many = plan(LLAMA3_8B, 8, ranks_per_node=2, instance="c7i.48xlarge")
    names = {v["variant"] for v in many["variants_compared"] if v["instance"] == "c7i.48xlarge"}
    assert {"zero2+striped", "zero3_in_node+striped"} <= names
    row = next(v for v in many["variants_compared"] if v["variant"] == "zero3_in_node+striped")
    assert row["settings"] == [
        "deepspeed.zero_stage=3",
        "deepspeed.hpz_partition_size=2",
        "deepspeed.cross_node_collectives=striped",
    ]
    one = plan("tiny", 2, ranks_per_node=2, instance="c7i.48xlarge")
    assert not any("striped" in v["variant"] for v in one["variants_compared"] if v["instance"] == "c7i.48xlarge")


def test_a_checkpoint_costs_its_gb_at_the_measured_seconds_per_gb():
    from raytrain_cpu.planner import ckpt

    P = LLAMA3_8B.num_params
    z3 = ckpt.checkpoint_cost(LLAMA3_8B, 8, zero_stage=3, checkpoint_every=25, step_time_s=60.0)
    assert z3["gb"] == pytest.approx(14 * P / 1e9)  # bf16 weights, fp32 master, two moments
    assert z3["save_s"] == pytest.approx(z3["gb"] / 8 * ckpt.SAVE_S_PER_RANK_GB)  # each rank its shard
    assert z3["save_share_of_run"] == pytest.approx(z3["save_s"] / (z3["save_s"] + 25 * 60.0))
    z2 = ckpt.checkpoint_cost(LLAMA3_8B, 8, zero_stage=2)
    assert z2["save_s"] == pytest.approx((2 * P + 12 * P / 8) / 1e9 * ckpt.SAVE_S_PER_RANK_GB)  # rank 0: the model
    lora = ckpt.checkpoint_cost(LLAMA3_8B, 2, lora_rank=16)
    assert lora["gb"] == pytest.approx((2 * P + 12 * LLAMA3_8B.lora_params(16)) / 1e9)
    assert lora["export_s"] == pytest.approx(2 * P / 1e9 * ckpt.EXPORT_S_PER_GB)
