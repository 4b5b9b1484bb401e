"""The spot-notice watcher (raytrain_cpu.launch.spot) against a stand-in for EC2's IMDS (helpers.FakeIMDS).

What a drain does to a training run, on a Ray Cluster: tests/test_fault_tolerance.py's elastic
scenario, whose spot notice comes through this watcher.
This module's in-process tests: tests/unit/test_spot.py."""

from __future__ import annotations

import pytest

from raytrain_cpu.launch import spot


def test_the_node_to_drain_is_the_one_at_this_machines_ip(ray_session):
    from ray._raylet import GcsClient

    nodes = GcsClient(address=ray_session.get_runtime_context().gcs_address).get_all_node_info()
    ip = ray_session.util.get_node_ip_address()
    assert spot.local_node_id(nodes, ip) == ray_session.get_runtime_context().get_node_id()
    with pytest.raises(
        spot.SpotError, match="0 live Ray nodes at 10.9.9.9, not 1: name the node to drain with --node-id"
    ):
        spot.local_node_id(nodes, "10.9.9.9")
