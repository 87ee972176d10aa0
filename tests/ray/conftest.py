"""Fixtures of the Ray tests: pools and groups of the test workers and of the real hybrid,
training and rollout workers on the tiny model, torn down after use."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ray import cloudpickle

from rlframe.controller.placement import ResourcePool
from rlframe.controller.worker_group import WorkerGroup
from tests.ray import workers_for_tests
from tests.ray.factories import TinyGroups
from tests.ray.workers_for_tests import EchoWorker

# Ray workers cannot import the tests package: ship the test worker classes by value.
cloudpickle.register_pickle_by_value(workers_for_tests)


@pytest.fixture
def make_group() -> Iterator:
    """Builds pools and groups and tears all of them down after the test."""
    made: list[tuple[ResourcePool, list[WorkerGroup]]] = []

    def make(
        world: int, *, timeout: float = 60.0, colocate: int = 1, roles: int = 1
    ) -> list[WorkerGroup]:
        pool = ResourcePool(
            nnodes=1, procs_per_node=world, device="cpu", cpus_per_proc=1, max_colocate=colocate
        )
        pool.create(timeout_s=30)
        groups: list[WorkerGroup] = []
        made.append((pool, groups))
        for i in range(roles):
            groups.append(
                WorkerGroup(
                    pool, EchoWorker, role=f"echo{i}", init_args=(2.0,), call_timeout_s=timeout
                )
            )
        return groups

    yield make
    for pool, groups in made:
        for g in groups:
            g.shutdown()
        pool.remove()


@pytest.fixture
def tiny_model_path(tmp_path: Path) -> str:
    """The tiny model's folder (weights, config, tokenizer), built for this test."""
    from rlframe.data.tiny_model import resolve_model_path

    return resolve_model_path("tiny:0", cache_dir=tmp_path)


@pytest.fixture
def tiny_hybrid_group(tiny_model_path: str) -> Iterator[TinyGroups]:
    """Builds groups of the real workers on the tiny model (``tiny_hybrid_group(cfg)``: a
    :class:`workers.hybrid.HybridWorker` group; see :class:`tests.ray.factories.TinyGroups`)
    and tears them down after the test."""
    groups = TinyGroups(tiny_model_path)
    yield groups
    groups.tear_down()
