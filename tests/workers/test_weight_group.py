"""The cross-pool weight group (desk check item 4): its collectives fail after the configured
timeout (NCCL kept its own 10-minute default), and the sender has one bucket in flight, not
the whole model (NCCL's ``wait`` does not block the host). Two real gloo ranks in two
processes; the NCCL group is built by the same code with the same options."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
from torch import nn

from rlframe.controller.weight_group import WeightGroupSpec
from tests.workers.layout_cases import free_port
from workers.sync.weight_sync import BroadcastReceiver, BroadcastSender, WeightGroup, WeightSource

BUCKETS = 5
BUCKET_BYTES = 16 * 2**20  # far above a loopback socket's buffer: a send needs its reader
CONSUME_S = 0.25
TIMEOUT_S = 2.0


def test_weight_group_collectives_take_the_configured_timeout() -> None:
    spec = WeightGroupSpec("127.0.0.1", free_port(), trainer_world=1, rollout_world=0)
    group = WeightGroup(spec, 0, "cpu", timeout_s=37.0)
    assert group.timeout == timedelta(seconds=37)


class SlowRollout:
    """The receiving rollout role's part in a pull: it loads tensors slower than they arrive
    (as an engine's weight loader does), and records when each one was loaded."""

    def __init__(self) -> None:
        self.loaded_at: list[float] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        for _, tensor in weights:
            assert tensor.numel() == BUCKET_BYTES // 4
            time.sleep(CONSUME_S)
            self.loaded_at.append(time.monotonic())


def send(spec: WeightGroupSpec, out: mp.Queue, done: mp.Event) -> None:
    group = WeightGroup(spec, 0, "cpu", timeout_s=TIMEOUT_S)
    gathered_at: list[float] = []

    def tensors(_: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(BUCKETS):
            gathered_at.append(time.monotonic())  # the source gathers bucket i now
            yield f"w{i}", torch.full((BUCKET_BYTES // 4,), float(i))

    BroadcastSender(group).push(WeightSource(nn.Module(), BUCKET_BYTES, tensors=tensors), 1)
    # The receiver never joins this one: it must fail after the group's timeout.
    start = time.monotonic()
    try:
        group.broadcast(torch.zeros(1))
        waited = None
    except RuntimeError:
        waited = time.monotonic() - start
    done.set()
    out.put(("sender", gathered_at, waited))


def receive(spec: WeightGroupSpec, out: mp.Queue, done: mp.Event) -> None:
    group = WeightGroup(spec, 1, "cpu", timeout_s=TIMEOUT_S)
    rollout = SlowRollout()
    version = BroadcastReceiver(group).pull(rollout)
    out.put(("receiver", rollout.loaded_at, version))
    done.wait(60)  # alive, but never joining the sender's last broadcast


def test_sender_has_one_bucket_in_flight_and_times_out() -> None:
    spec = WeightGroupSpec("127.0.0.1", free_port(), trainer_world=1, rollout_world=1)
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=f, args=(spec, out, done)) for f in (send, receive)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            role, times, extra = out.get(timeout=60)
            results[role] = (times, extra)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    gathered_at, waited = results["sender"]
    loaded_at, version = results["receiver"]
    assert version == 1 and len(loaded_at) == BUCKETS
    # Bucket i + 2 is gathered only after the receiver has loaded bucket i: the sender
    # waited for each broadcast to finish before it gathered the next bucket.
    for i in range(BUCKETS - 2):
        assert gathered_at[i + 2] >= loaded_at[i], (i, gathered_at, loaded_at)
    assert waited is not None and TIMEOUT_S * 0.9 <= waited <= TIMEOUT_S + 15, waited
