"""Dispatch, placement and failure handling on a real local Ray cluster."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray
import torch

from rlframe.controller.placement import PlacementError, ResourcePool
from rlframe.controller.worker_group import WorkerError, WorkerGroup
from rlframe.core.protocol import Batch
from tests.ray.workers_for_tests import BrokenWorker, EchoWorker, rows

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.mark.parametrize("world,n", [(2, 5), (3, 7), (3, 2), (2, 8)])
def test_dp_split_round_trip_strips_padding(make_group, world: int, n: int) -> None:
    (group,) = make_group(world)
    out = group.scale_rows(rows(n), offset=1.0)
    assert len(out) == n
    torch.testing.assert_close(out["y"], torch.arange(n, dtype=torch.float32) * 2 + 1)
    assert list(out["tag"]) == [f"row{i}" for i in range(n)]
    # Consecutive chunks go to consecutive ranks.
    padded = n + (-n) % world
    expected_ranks = torch.arange(padded) // (padded // world)
    assert out["rank"].tolist() == expected_ranks[:n].tolist()


def test_dp_split_non_batch_results_come_back_per_rank(make_group) -> None:
    (group,) = make_group(3)
    assert group.count_rows(rows(7)) == [3, 3, 3]  # 7 rows padded to 9


def test_one_to_all_sets_rank_environment(make_group) -> None:
    (group,) = make_group(3)
    envs = group.env()
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and envs[0]["MASTER_PORT"].isdigit()
    assert {e["RLFRAME_ROLE"] for e in envs} == {"echo0"}
    assert group.all_reduce_ranks() == [3.0, 3.0, 3.0]


def test_rank_zero_runs_on_rank_zero_only(make_group) -> None:
    (group,) = make_group(3)
    assert group.whoami() == 0
    assert group.whoami() == 0
    # Ranks 1 and 2 never ran it: a RANK_ZERO call is one remote call, not a broadcast.
    assert [c.get("whoami", 0) for c in group.call_counts()] == [2, 0, 0]


def bundle_free_cpus(pool: ResourcePool) -> list[float]:
    """Unused CPUs in each bundle of a one-node pool (Ray's per-bundle resources)."""
    pg_id = pool.placement_groups[0].id.hex()
    free = ray.available_resources()
    return [free.get(f"CPU_group_{i}_{pg_id}", 0.0) for i in range(pool.procs_per_node)]


def wait_for_free_cpus(pool: ResourcePool, expected: list[float], timeout_s: float = 30.0) -> None:
    """Ray returns a killed actor's resources asynchronously: poll until they are back."""
    deadline = time.monotonic() + timeout_s
    while bundle_free_cpus(pool) != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    assert bundle_free_cpus(pool) == expected


def test_colocated_roles_share_bundles() -> None:
    pool = ResourcePool(
        nnodes=1, procs_per_node=2, device="cpu", cpus_per_proc=1, max_colocate=2, name="colocated"
    )
    pool.create(timeout_s=30)
    groups: list[WorkerGroup] = []
    try:
        actor = WorkerGroup(pool, EchoWorker, role="echo0", init_args=(2.0,), call_timeout_s=60)
        groups.append(actor)
        # One actor per bundle, each taking half of it: not both ranks in one bundle.
        wait_for_free_cpus(pool, [0.5, 0.5])
        critic = WorkerGroup(pool, EchoWorker, role="echo1", init_args=(2.0,), call_timeout_s=60)
        groups.append(critic)
        wait_for_free_cpus(pool, [0.0, 0.0])
        # Rank r of each role sits in bundle r: killing one rank frees half of its bundle only.
        ray.kill(actor.actors[0], no_restart=True)
        wait_for_free_cpus(pool, [0.5, 0.0])
        ray.kill(critic.actors[1], no_restart=True)
        wait_for_free_cpus(pool, [0.5, 0.5])
    finally:
        for g in groups:
            g.shutdown()
        pool.remove()


def test_colocated_roles_get_their_own_rendezvous(make_group) -> None:
    actor, critic = make_group(2, colocate=2, roles=2)
    a, c = actor.describe(), critic.describe()
    assert [d["rank"] for d in a] == [0, 1] and [d["rank"] for d in c] == [0, 1]
    # Each role got its own rendezvous, so their process groups do not collide.
    assert a[0]["master"] != c[0]["master"]
    assert actor.all_reduce_ranks() == [1.0, 1.0] and critic.all_reduce_ranks() == [1.0, 1.0]


def test_worker_that_raises_names_role_rank_and_method(make_group) -> None:
    (group,) = make_group(3)
    with pytest.raises(WorkerError) as info:
        group.fail_on(rank=2)
    err = info.value
    assert (err.role, err.rank, err.method) == ("echo0", 2, "fail_on")
    assert "ValueError: bad input on rank 2" in str(err)
    assert "echo0 worker rank 2 failed in fail_on()" in str(err)


def test_worker_killed_mid_call_is_reported_not_hung(make_group) -> None:
    (group,) = make_group(2, timeout=120)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        group.die_on(rank=1)
    assert time.monotonic() - start < 60
    assert (info.value.rank, info.value.method) == (1, "die_on")
    assert "died" in str(info.value)


def test_call_that_outlives_timeout_is_reported(make_group) -> None:
    (group,) = make_group(2, timeout=2)
    with pytest.raises(WorkerError, match=r"did not answer within 2 s") as info:
        group.sleep(30)
    assert info.value.method == "sleep"


def test_constructor_failure_names_init() -> None:
    pool = ResourcePool(nnodes=1, procs_per_node=2, device="cpu")
    pool.create(timeout_s=30)
    try:
        with pytest.raises(WorkerError) as info:
            WorkerGroup(pool, BrokenWorker, role="actor", call_timeout_s=60)
        assert info.value.method == "__init__"
        assert "cannot load the model" in str(info.value)
    finally:
        pool.remove()


def test_unknown_method_lists_the_known_ones(make_group) -> None:
    (group,) = make_group(2)
    with pytest.raises(AttributeError, match="scale_rows"):
        group.generate(rows(2))


def test_pool_larger_than_cluster_fails_clearly() -> None:
    pool = ResourcePool(nnodes=1, procs_per_node=16, device="cpu", name="too_big")
    with pytest.raises(
        PlacementError,
        match=r"resource pool 'too_big' needs 1 node\(s\) x 16 bundle\(s\).*could not place",
    ):
        pool.create(timeout_s=3)
    # It fails before reserving anything: no placement group is left waiting for resources.
    # (A request that times out removes what it reserved: tests/ray/test_placement.py.)
    table = ray.util.placement_group_table()
    left = [g["state"] for g in table.values() if g["name"].startswith("too_big")]
    assert all(state == "REMOVED" for state in left), left


def test_dp_split_method_that_raises_names_the_rank(make_group) -> None:
    (group,) = make_group(2)
    with pytest.raises(WorkerError) as info:
        group.fail_rows_on(rows(4), rank=1)
    assert (info.value.rank, info.value.method) == (1, "fail_rows_on")
    assert "ValueError: bad rows on rank 1" in str(info.value)


def test_rank_zero_method_that_raises_names_rank_zero(make_group) -> None:
    (group,) = make_group(2)
    with pytest.raises(WorkerError) as info:
        group.fail_rank_zero()
    assert (info.value.rank, info.value.method) == (0, "fail_rank_zero")
    assert "ValueError: rank-zero method failed on rank 0" in str(info.value)


def test_dp_split_calls_need_batches_of_one_length(make_group) -> None:
    (group,) = make_group(2)
    with pytest.raises(
        TypeError, match="a DP_SPLIT method needs at least one Batch or TrainBatch argument"
    ):
        group.scale_rows(torch.arange(4.0))
    with pytest.raises(
        ValueError, match=r"DP_SPLIT Batch arguments have different lengths: \[3, 4\]"
    ):
        group.add_rows(rows(4), b=rows(3))
    # Refused on the driver: no rank was called.
    assert [c.get("add_rows", 0) for c in group.call_counts()] == [0, 0]
    out = group.add_rows(rows(3), b=rows(3))  # a kwarg Batch is split like a positional one
    torch.testing.assert_close(out["y"], torch.arange(3, dtype=torch.float32) * 2)


def test_worker_returning_the_wrong_number_of_rows_is_named(make_group) -> None:
    (group,) = make_group(2)
    with pytest.raises(
        ValueError,
        match=r"rank 1 returned 1 rows for 2 input rows; "
        r"a DP_SPLIT method must return one row per input row",
    ):
        group.drop_row_on(rows(4), rank=1)


def test_batch_column_object_identity_survives_ray(make_group) -> None:
    (group,) = make_group(2)
    batch = Batch({"x": torch.zeros(3)}, {"tag": np.array(["a", "b", "c"], dtype=object)})
    assert list(group.scale_rows(batch)["tag"]) == ["a", "b", "c"]
