"""The groups of a run start at once: a group started with ``wait=False`` returns while its
constructors run, and one wait covers them all; a constructor's failure is named as such."""

from __future__ import annotations

import sys
import time

import pytest
from ray import cloudpickle

from rlframe.controller.dispatch import Dispatch, dispatch
from rlframe.controller.placement import ResourcePool
from rlframe.controller.worker import Worker
from rlframe.controller.worker_group import WorkerError, WorkerGroup, wait_calls

pytestmark = pytest.mark.usefixtures("ray_cluster")
# Ray workers cannot import the tests package: ship this module's classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class SlowStartWorker(Worker):
    """A constructor that takes ``seconds``, and says when it ran."""

    def __init__(self, seconds: float, fail: bool = False) -> None:
        super().__init__()
        self.began = time.time()
        time.sleep(seconds)
        if fail:
            raise RuntimeError("engine did not build")
        self.ended = time.time()

    @dispatch(Dispatch.RANK_ZERO)
    def constructed(self) -> tuple[float, float]:
        return self.began, self.ended


@pytest.fixture
def pool():
    pool = ResourcePool(nnodes=1, procs_per_node=1, device="cpu", cpus_per_proc=1, max_colocate=2)
    pool.create(timeout_s=30)
    yield pool
    pool.remove()


def test_groups_started_without_waiting_construct_at_once(pool: ResourcePool) -> None:
    groups = [
        WorkerGroup(pool, SlowStartWorker, role=role, init_args=(3.0,), wait=False)
        for role in ("actor", "critic")
    ]
    try:
        assert all(g.started.outcome is None for g in groups)  # returned before construction
        wait_calls(*(g.started for g in groups))
        (a_began, a_ended), (b_began, b_ended) = (g.constructed() for g in groups)
        # The second constructor began before the first one ended: they overlapped.
        assert b_began < a_ended and a_began < b_ended
        assert all(g.report_startup()["boot"] > 0 for g in groups)
    finally:
        for g in groups:
            g.shutdown()


def test_a_constructor_failure_among_groups_started_at_once_is_named(pool: ResourcePool) -> None:
    groups = [
        WorkerGroup(pool, SlowStartWorker, role="actor", init_args=(3.0,), wait=False),
        WorkerGroup(pool, SlowStartWorker, role="critic", init_args=(0.0, True), wait=False),
    ]
    try:
        with pytest.raises(WorkerError) as failed:
            wait_calls(*(g.started for g in groups))
        text = str(failed.value)
        assert "critic" in text and "__init__" in text and "engine did not build" in text
    finally:
        for g in groups:
            g.shutdown()
