"""Dispatch, placement and failure handling on a real local Ray cluster."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from rlframe.controller.placement import PlacementError, ResourcePool
from rlframe.controller.worker_group import WorkerError, WorkerGroup
from rlframe.protocol import Batch
from tests.ray.test_workers import BrokenWorker, EchoWorker

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture
def make_group() -> Iterator:
    """Builds pools and groups and tears all of them down after the test."""
    made: list[tuple[ResourcePool, list[WorkerGroup]]] = []

    def make(world: int, *, timeout: float = 60.0, colocate: int = 1, roles: int = 1) -> list[WorkerGroup]:
        pool = ResourcePool(nnodes=1, procs_per_node=world, device="cpu", cpus_per_proc=1, max_colocate=colocate)
        pool.create(timeout_s=30)
        groups: list[WorkerGroup] = []
        made.append((pool, groups))
        for i in range(roles):
            groups.append(
                WorkerGroup(pool, EchoWorker, role=f"echo{i}", init_args=(2.0,), call_timeout_s=timeout)
            )
        return groups

    yield make
    for pool, groups in made:
        for g in groups:
            g.shutdown()
        pool.remove()


def rows(n: int) -> Batch:
    return Batch({"x": torch.arange(n, dtype=torch.float32)}, {"tag": [f"row{i}" for i in range(n)]})


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
    (group,) = make_group(2)
    assert group.whoami() == 0


def test_colocated_roles_share_bundles(make_group) -> None:
    actor, critic = make_group(2, colocate=2, roles=2)
    a, c = actor.describe(), critic.describe()
    assert [d["rank"] for d in a] == [0, 1] and [d["rank"] for d in c] == [0, 1]
    assert {d["placement_group_id"] for d in a} == {d["placement_group_id"] for d in c}
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
    pool = ResourcePool(nnodes=1, procs_per_node=16, device="cpu")
    with pytest.raises(PlacementError, match="could not place"):
        pool.create(timeout_s=3)
    assert not pool.placement_groups


def test_batch_column_object_identity_survives_ray(make_group) -> None:
    (group,) = make_group(2)
    batch = Batch({"x": torch.zeros(3)}, {"tag": np.array(["a", "b", "c"], dtype=object)})
    assert list(group.scale_rows(batch)["tag"]) == ["a", "b", "c"]
