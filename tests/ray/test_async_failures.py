"""A rollout worker that dies with the producer's requests in flight (on its thread) is named
as in lockstep (role, rank, method), and the producer does not hang on it."""

from __future__ import annotations

import time

import pytest
import ray

from rlframe.controller.worker_group import WorkerError
from tests.unit.scripted_engine import Engine, make_producer

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_worker_dying_with_requests_in_flight_is_named(make_group) -> None:
    (group,) = make_group(1, timeout=120)
    producer = make_producer(Engine(), k=1, chunk=3, overlap=True)
    # The call in flight never answers by itself: the worker dies under it.
    producer.context.generate = lambda prompts: group.submit("sleep", 600).result()
    producer.launch_call()
    assert producer.call is not None
    time.sleep(1.0)
    ray.kill(group.actors[0], no_restart=True)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        producer.next_batch()
    assert time.monotonic() - start < 60
    assert (info.value.role, info.value.rank, info.value.method) == ("echo0", 0, "sleep")
    assert "the worker process died" in str(info.value)
