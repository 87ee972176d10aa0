"""A pool of processes that score rule rewards in parallel, each sample under a time limit.

Each worker is ``python -m rlframe.rewards.pool_worker SPEC`` in its own session, fed one
sample at a time over a pipe. A sample that runs past the limit gets its worker's whole
process group killed (anything the reward started dies with it) and a fresh worker takes
its place; the sample's Outcome says it timed out. A worker that dies mid-sample is
replaced the same way. The time limit starts when the sample is sent, never while a
worker is still importing.
"""

from __future__ import annotations

import math
import os
import select
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from rlframe.rewards.frames import read_frame, write_frame
from rlframe.rewards.outcome import Outcome
from rlframe.rewards.registry import RewardError
from rlframe.rewards.sandbox_cgroups import remove_cgroups_of

START_TIMEOUT_S = 120.0
"""Longest wait for a worker to import and load the reward function."""


class PoolWorker:
    """One scoring process and its pipes."""

    def __init__(self, spec: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlframe.rewards.pool_worker", spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            start_new_session=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.to_worker, self.from_worker = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        self.started = time.monotonic()

    def fileno(self) -> int:
        return self.from_worker

    def send(self, message: Any) -> bool:
        """False when the worker is gone."""
        try:
            write_frame(self.to_worker, message)
            return True
        except (BrokenPipeError, OSError):
            return False

    def receive(self) -> tuple[bool, Any]:
        return read_frame(self.from_worker)

    def kill(self) -> None:
        """SIGKILL the worker's process group (its own children too) and reap it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        # Its sandboxes died with it (PDEATHSIG); their cgroups are this parent's to remove.
        remove_cgroups_of(self.proc.pid)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()

    def describe_death(self) -> str:
        code = self.proc.wait()
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return f"killed its scoring process ({how})"


class RewardPool:
    """``num_workers`` processes scoring the reward ``spec``, ``timeout_s`` per sample."""

    def __init__(self, spec: str, num_workers: int, timeout_s: float) -> None:
        self.spec, self.timeout_s = spec, timeout_s
        self.ready: list[PoolWorker] = []
        self.starting: list[PoolWorker] = [PoolWorker(spec) for _ in range(num_workers)]
        try:
            while self.starting:
                self.wait_for_starting(START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self.restarts = 0

    def wait_for_starting(self, timeout_s: float) -> None:
        """Move workers that said ``ready`` from ``starting`` to ``ready``; raise for one that
        cannot load the function or takes longer than START_TIMEOUT_S."""
        readable, _, _ = select.select(self.starting, [], [], timeout_s)
        for worker in readable:
            self.starting.remove(worker)
            alive, message = worker.receive()
            if not alive or message[0] != "ready":
                reason = message[1] if alive else worker.describe_death()
                worker.kill()
                raise RewardError(f"reward worker for {self.spec!r} could not start: {reason}")
            self.ready.append(worker)
        late = [w for w in self.starting if time.monotonic() - w.started > START_TIMEOUT_S]
        if late:
            raise RewardError(
                f"reward worker for {self.spec!r} did not start within {START_TIMEOUT_S:.0f} s"
            )

    def replace(self, worker: PoolWorker) -> None:
        worker.kill()
        self.restarts += 1
        self.starting.append(PoolWorker(self.spec))

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[str],
        samples: Sequence[dict[str, Any]],
        fail_fast: bool = False,
        deadline_s: float | None = None,
    ) -> list[Outcome]:
        """One Outcome per sample, in order. ``fail_fast``: at the first failure (error,
        timeout, dead worker) the samples still running are killed and the rest are not
        started; both come back ``cancelled``. ``deadline_s`` bounds the whole call: samples
        not scored by then come back timed out."""
        outcomes: list[Outcome | None] = [None] * len(responses)
        pending = deque(range(len(responses)))
        busy: dict[PoolWorker, tuple[int, float]] = {}
        stage_end = time.monotonic() + deadline_s if deadline_s else math.inf
        try:
            while pending or busy:
                while pending and self.ready:
                    worker, i = self.ready.pop(), pending.popleft()
                    if worker.send((i, responses[i], ground_truths[i], samples[i])):
                        busy[worker] = (i, time.monotonic() + self.timeout_s)
                    else:
                        pending.appendleft(i)  # died while idle: the sample is not to blame
                        self.replace(worker)
                self.collect(busy, outcomes, stage_end)
                failed = fail_fast and any(o is not None and o.score is None for o in outcomes)
                if failed or time.monotonic() >= stage_end:
                    self.stop(busy, pending, outcomes, cancelled=failed, deadline_s=deadline_s)
        except BaseException:
            for worker in busy:  # mid-sample: their answers would arrive out of turn
                worker.kill()
            raise
        return [o for o in outcomes if o is not None]

    def stop(
        self,
        busy: dict[PoolWorker, tuple[int, float]],
        pending: deque[int],
        outcomes: list[Outcome | None],
        cancelled: bool,
        deadline_s: float | None,
    ) -> None:
        """End the call early: kill the workers mid-sample (fresh ones take their place) and
        give every unscored sample its outcome."""
        unscored = [i for i, _ in busy.values()] + list(pending)
        for worker in list(busy):
            self.replace(worker)
        busy.clear()
        pending.clear()
        for i in unscored:
            if cancelled:
                outcomes[i] = Outcome(None, "cancelled after another sample failed", cancelled=True)
            else:
                why = f"not scored within the stage's {deadline_s:g} s (reward.step_timeout_s)"
                outcomes[i] = Outcome(None, why, timed_out=True)

    def collect(
        self,
        busy: dict[PoolWorker, tuple[int, float]],
        outcomes: list[Outcome | None],
        stage_end: float = math.inf,
    ) -> None:
        """Wait for the next answer, deadline or started worker; record what arrived."""
        deadlines = [d for _, d in busy.values()]
        wait = min([*deadlines, stage_end, time.monotonic() + START_TIMEOUT_S])
        readable, _, _ = select.select(
            [*busy, *self.starting], [], [], max(0.0, wait - time.monotonic())
        )
        for worker in readable:
            if worker in self.starting:
                self.wait_for_starting(0)
                continue
            if worker not in busy:
                continue  # a replacement that the wait just above already moved to ready
            i, _ = busy.pop(worker)
            alive, message = worker.receive()
            if alive:
                _, score, error = message
                outcomes[i] = Outcome(score, error)
                self.ready.append(worker)
            else:
                outcomes[i] = Outcome(None, worker.describe_death())
                self.replace(worker)
        now = time.monotonic()
        for worker, (i, deadline) in list(busy.items()):
            if now >= deadline:
                del busy[worker]
                outcomes[i] = Outcome(
                    None, f"timed out after {self.timeout_s:g} s (reward.timeout_s)", timed_out=True
                )
                self.replace(worker)

    def close(self) -> None:
        for worker in [*self.ready, *self.starting]:
            worker.kill()
        self.ready, self.starting = [], []
