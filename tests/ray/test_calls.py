"""Non-blocking worker-group calls (submit / result / wait_calls) and read-only dispatch,
on a real local Ray cluster."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
import torch

from rlframe.controller.worker_group import WorkerError, wait_calls
from rlframe.core.protocol import Batch
from tests.ray.workers_for_tests import rows

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_handle_result_equals_the_blocking_call(make_group) -> None:
    (group,) = make_group(2)
    batch = rows(5)
    handle = group.submit("scale_rows", batch, offset=1.0)
    blocking = group.scale_rows(batch, offset=1.0)
    out = handle.result()
    for key in ("y", "rank"):
        torch.testing.assert_close(out[key], blocking[key])
    assert list(out["tag"]) == list(blocking["tag"])
    assert group.submit("env").result() == group.env()
    assert group.submit("whoami").result() == 0
    # A settled handle keeps its result.
    assert out is handle.result()


def test_handles_of_several_groups_run_at_once(make_group) -> None:
    a, b = make_group(1, roles=2, colocate=2)
    start = time.monotonic()
    handles = [a.submit("sleep", 3), b.submit("sleep", 3)]
    assert time.monotonic() - start < 1.0  # submit does not wait
    assert wait_calls(*handles) == [[0], [0]]
    # Both slept at the same time, in their own processes.
    assert time.monotonic() - start < 5.5


def test_worker_dying_under_an_outstanding_handle_is_named(make_group) -> None:
    (group,) = make_group(2, timeout=120)
    handle = group.submit("die_on", rank=1)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        handle.result()
    assert time.monotonic() - start < 60
    err = info.value
    assert (err.role, err.rank, err.method) == ("echo0", 1, "die_on")
    assert "echo0 worker rank 1 failed in die_on(): the worker process died" in str(err)
    # The outcome is kept: asking again raises the same error without waiting.
    with pytest.raises(WorkerError) as again:
        handle.result()
    assert again.value is err


def test_worker_killed_while_a_handle_is_outstanding_is_named(make_group) -> None:
    (group,) = make_group(2, timeout=120)
    handle = group.submit("sleep", 600)
    time.sleep(1.0)
    ray.kill(group.actors[0], no_restart=True)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        handle.result()
    assert time.monotonic() - start < 60
    assert (info.value.role, info.value.rank, info.value.method) == ("echo0", 0, "sleep")
    assert "died" in str(info.value)


@pytest.mark.parametrize("dead_first", [True, False])
def test_wait_on_two_groups_names_the_one_that_died(make_group, dead_first: bool) -> None:
    """A sender and a receiver: the receiver dies, the sender would block forever (here: a
    600 s sleep); the wait on both ends promptly with the dead side's name."""
    sender, receiver = make_group(1, roles=2, colocate=2, timeout=300)
    alive = sender.submit("sleep", 600)
    dying = receiver.submit("die_on", rank=0)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        wait_calls(*((dying, alive) if dead_first else (alive, dying)))
    assert time.monotonic() - start < 30
    assert (info.value.role, info.value.rank, info.value.method) == ("echo1", 0, "die_on")


@pytest.mark.parametrize("sender_call", [("sleep", 600), ("fail_on", 0)], ids=["expires", "raises"])
def test_a_stopped_rank_is_named_not_the_peer_that_waited_for_it(
    make_group, sender_call: tuple[str, int]
) -> None:
    """A weight sync with a rollout rank stopped (SIGSTOP): the sender is blocked until the
    deadline (or its collective raises, as gloo's timeout does) while the stopped receiver
    stays silent. The stopped rank is named (the rollout's receive_weights), not the sender
    (the trainer's send_weights), and the sender's failure is said after it."""
    sender, receiver = make_group(1, roles=2, colocate=2, timeout=4)
    (info,) = receiver.describe()
    os.kill(info["pid"], signal.SIGSTOP)
    try:
        waiting = sender.submit(*sender_call)
        stopped = receiver.submit("sleep", 0)
        with pytest.raises(WorkerError) as failure:
            wait_calls(waiting, stopped)
    finally:
        os.kill(info["pid"], signal.SIGCONT)
    error = failure.value
    assert (error.role, error.rank, error.method) == ("echo1", 0, "sleep")
    assert error.detail.startswith(
        f"the worker process (pid {info['pid']}) is stopped (SIGSTOP, or held by a debugger) "
        f"and did not answer; echo0 {sender_call[0]}() failed waiting for it: echo0 worker "
    )


def test_wait_on_two_groups_reports_a_raise_on_either(make_group) -> None:
    a, b = make_group(2, roles=2, colocate=2, timeout=300)
    with pytest.raises(WorkerError) as info:
        wait_calls(a.submit("sleep", 600), b.submit("fail_on", rank=1))
    assert (info.value.role, info.value.rank, info.value.method) == ("echo1", 1, "fail_on")
    assert "ValueError: bad input on rank 1" in str(info.value)


def test_handle_past_its_deadline_is_reported(make_group) -> None:
    (group,) = make_group(2, timeout=2)
    handle = group.submit("sleep", 30)
    with pytest.raises(WorkerError, match=r"ranks \[0, 1\] did not answer within 2 s") as info:
        handle.result()
    assert (info.value.role, info.value.rank, info.value.method) == ("echo0", None, "sleep")


def test_only_the_declared_keys_cross_the_wire(make_group) -> None:
    (group,) = make_group(2)
    batch = rows(4).with_tensors(unread=torch.zeros(4))
    out = group.keys_seen(batch)
    assert [list(s) for s in out["seen"]] == [["x"]] * 4
    torch.testing.assert_close(out["y"], batch["x"])
    # An optional key goes when it is there; meta always goes.
    with_maybe = Batch(batch.tensors | {"maybe": torch.ones(4)}, batch.columns, {"m": 1})
    assert [list(s) for s in group.keys_seen(with_maybe)["seen"]] == [["maybe", "x"]] * 4


def test_a_batch_without_any_declared_key_is_refused(make_group) -> None:
    (group,) = make_group(2)
    with pytest.raises(ValueError, match=r"keys_seen\(\) reads \['x', 'maybe'\] but its Batch"):
        group.keys_seen(Batch({"other": torch.zeros(3)}))
