"""Placement on the session's Ray cluster (one node, 4 CPUs): what never fits fails at once,
what fits later waits and says what it waits for."""

from __future__ import annotations

import logging
import time

import pytest
import ray

from rlframe.controller.placement import PlacementError, ResourcePool

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_more_than_any_node_has_fails_at_once() -> None:
    pool = ResourcePool(nnodes=1, procs_per_node=3, device="cpu", cpus_per_proc=2, name="too_big")
    start = time.monotonic()
    with pytest.raises(
        PlacementError, match="could not place and never can: no node has that much"
    ):
        pool.create(timeout_s=600)
    assert time.monotonic() - start < 5


def test_more_nodes_than_exist_fails_at_once() -> None:
    pool = ResourcePool(nnodes=2, procs_per_node=1, device="cpu", cpus_per_proc=1, name="two_nodes")
    with pytest.raises(PlacementError, match=r"only 1 node\(s\) of 1"):
        pool.create(timeout_s=600)


def test_gpus_on_a_cpu_cluster_fail_at_once() -> None:
    pool = ResourcePool(nnodes=1, procs_per_node=1, device="cuda", cpus_per_proc=1, name="gpu")
    with pytest.raises(PlacementError, match="could not place and never can"):
        pool.create(timeout_s=600)


def test_resources_in_use_make_it_wait_and_say_what_for(caplog: pytest.LogCaptureFixture) -> None:
    holder = ResourcePool(nnodes=1, procs_per_node=3, device="cpu", cpus_per_proc=1, name="holder")
    holder.create(timeout_s=60)
    try:
        waiter = ResourcePool(
            nnodes=1, procs_per_node=2, device="cpu", cpus_per_proc=1, name="waiter"
        )
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rlframe.controller.placement"):
            with pytest.raises(PlacementError, match="could not place within 3 s"):
                waiter.create(timeout_s=3, report_every_s=1)
        assert 2.5 < time.monotonic() - start < 15
        waits = [
            r.getMessage() for r in caplog.records if "waiting for placement" in r.getMessage()
        ]
        assert (
            waits
            and "'waiter' needs 1 node(s) x 2 bundle(s)" in waits[0]
            and "free now" in waits[0]
        )
        # What the timed-out request reserved is removed, not left pending forever.
        states = [
            g["state"]
            for g in ray.util.placement_group_table().values()
            if g["name"].startswith("waiter")
        ]
        assert states and all(state == "REMOVED" for state in states), states
    finally:
        holder.remove()
    # Once the holder is gone, the same request is placed.
    waiter = ResourcePool(nnodes=1, procs_per_node=2, device="cpu", cpus_per_proc=1, name="waiter")
    waiter.create(timeout_s=30)
    waiter.remove()


def test_a_port_on_the_drivers_node_is_found_without_a_ray_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A task for it once aborted in Ray's core worker ("Mutex corrupt", 13 console lines): on
    the driver's node, which every rank of this one-node cluster is on, the driver binds it.
    The task put in the module's place fails the test if it is ever submitted."""
    from rlframe.controller import placement

    @ray.remote(num_cpus=0)
    def must_not_run() -> None:
        raise AssertionError("a Ray task looked for a port on the driver's own node")

    task = placement.find_free_port_task
    pool = ResourcePool(nnodes=1, procs_per_node=2, device="cpu", cpus_per_proc=1)
    pool.create(timeout_s=30)
    try:
        monkeypatch.setattr(placement, "find_free_port_task", must_not_run)
        host, port = pool.find_free_port(1)
        assert host == ray.util.get_node_ip_address() and 0 < port < 65536
        assert pool.find_master_address()[0] == "127.0.0.1"
    finally:
        pool.remove()
    # On another node the same function runs as a task there; it works as one.
    assert ray.get(task.remote(), timeout=60)[0] == host
