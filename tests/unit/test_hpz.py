"""deepspeed.hpz_partition_size (ZeRO++ hpZ): what reaches DeepSpeed's config, the 0 that takes a
node's ranks, and the checks that stop a bad value before Ray starts rather than in DeepSpeed's
assertion after every worker loaded the model."""

from __future__ import annotations

import pytest

from raytrain_cpu.config.checks import ConfigError, check_hpz_partition, resolve_hpz_partition
from raytrain_cpu.config.schema import load_config
from raytrain_cpu.trainer.engine import deepspeed_config


def _zero(overrides: list[str], world: int = 4) -> dict:
    return deepspeed_config(load_config(None, overrides), world)["zero_optimization"]


def test_flat_zero3_config_is_left_as_it_was():
    """1 (the default) writes no key: DeepSpeed's own default is flat ZeRO-3, and configs stay
    as every earlier run's."""
    assert "zero_hpz_partition_size" not in _zero([])
    assert "zero_hpz_partition_size" not in _zero(["deepspeed.hpz_partition_size=1"])


def test_a_size_reaches_deepspeed_and_parses_there():
    zero = _zero(["deepspeed.hpz_partition_size=2"])
    assert zero["zero_hpz_partition_size"] == 2
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert DeepSpeedZeroConfig(**zero).zero_hpz_partition_size == 2  # DeepSpeed reads the key we write


def test_zero_takes_the_ranks_of_this_node(monkeypatch):
    """0: Ray Train's local world size (LOCAL_WORLD_SIZE, which it and init_local_group set)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _zero(["deepspeed.hpz_partition_size=0"])["zero_hpz_partition_size"] == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank a node: nothing to keep within it
    assert "zero_hpz_partition_size" not in _zero(["deepspeed.hpz_partition_size=0"])
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE"):
        _zero(["deepspeed.hpz_partition_size=0"])


def test_a_size_that_does_not_divide_the_ranks_stops_the_worker_clearly(monkeypatch):
    with pytest.raises(ConfigError, match=r"deepspeed.hpz_partition_size: 3 does not divide the 4 ranks"):
        _zero(["deepspeed.hpz_partition_size=3"])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # nodes of 3 and 1 ranks
    with pytest.raises(ConfigError, match=r"3 \(the ranks on this node\) does not divide the 4 ranks"):
        _zero(["deepspeed.hpz_partition_size=0"])
    assert resolve_hpz_partition(4, 8, 0) == 4


def test_hpz_needs_zero3_and_a_size_of_at_least_0():
    with pytest.raises(ConfigError, match=r"deepspeed.zero_stage=2 does not partition parameters; set deepspeed"):
        load_config(None, ["deepspeed.zero_stage=2", "deepspeed.hpz_partition_size=2"])
    with pytest.raises(ConfigError, match="must be >= 0"):
        load_config(None, ["deepspeed.hpz_partition_size=-1"])
    load_config(None, ["deepspeed.zero_stage=2"])  # the default (1) is every stage's


def test_size_must_divide_every_worker_count():
    check_hpz_partition(2, 3, [4])
    check_hpz_partition(0, 3, [3])  # a node's ranks: checked in the worker, where they are known
    check_hpz_partition(1, 3, [3])
    with pytest.raises(ConfigError, match=r"4 does not divide 6 workers .* one of 1, 2, 3, 6\."):
        check_hpz_partition(4, 3, [6])
    with pytest.raises(ConfigError, match="does not divide 3 workers"):
        check_hpz_partition(2, 3, range(2, 5))  # elastic: 2..4 workers
