"""Requests of concurrent sessions gathered into one engine ``generate`` call.

The engine is reached through the ``generate`` callable the producer's AgentContext holds
(a blocking Ray call), on one worker thread: while it runs, new requests queue up and go
out together in the next call. A queue is sent when every open session has a request in it
(nobody else is coming) or ``agent.batch_wait_ms`` after its first request, whichever is
first. The sampling temperature is the run's (``rollout.temperature``, or what the batch's
meta says: greedy ReMax baselines, validation), the one the trainer's log-probs assume.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rlframe.core.protocol import Batch
from rlframe.rollout.rows import build_request


@dataclass
class Turn:
    ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weights_version: int


@dataclass
class Request:
    context: list[int]
    max_tokens: int
    seed: int
    future: asyncio.Future[Turn] = field(repr=False)


class GenerateBatcher:
    """Args:
    generate: the engine's generate (one turn per row).
    open_sessions: how many sessions are open now (a full queue needs no more waiting).
    wait_s: longest wait for more requests after the first of a queue.
    """

    def __init__(
        self, generate: Callable[[Batch], Batch], open_sessions: Callable[[], int], wait_s: float
    ) -> None:
        self.generate, self.open_sessions, self.wait_s = generate, open_sessions, wait_s
        self.meta: dict[str, Any] = {}
        self.queue: list[Request] = []
        self.arrived: asyncio.Event | None = None
        self.worker: asyncio.Task[None] | None = None
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="agent-server-generate")
        self.calls = 0
        self.rows = 0

    @property
    def pending(self) -> int:
        return len(self.queue)

    async def sample(self, context: list[int], max_tokens: int, seed: int) -> Turn:
        loop = asyncio.get_running_loop()
        if self.arrived is None:
            self.arrived = asyncio.Event()
        request = Request(context, max_tokens, seed, loop.create_future())
        self.queue.append(request)
        self.arrived.set()
        if self.worker is None or self.worker.done():
            self.worker = asyncio.create_task(self.drain())
        return await request.future

    async def drain(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.arrived is not None
        while self.queue:
            deadline = loop.time() + self.wait_s
            while len(self.queue) < self.open_sessions() and loop.time() < deadline:
                self.arrived.clear()
                try:
                    await asyncio.wait_for(self.arrived.wait(), deadline - loop.time())
                except TimeoutError:
                    break
            group, self.queue = self.queue, []
            try:
                turns = await loop.run_in_executor(self.executor, self.run, group)
            except Exception as e:  # every waiting request gets the engine's error
                for r in group:
                    if not r.future.done():
                        r.future.set_exception(e)
                continue
            for r, t in zip(group, turns):
                if not r.future.done():
                    r.future.set_result(t)

    def run(self, group: list[Request]) -> list[Turn]:
        """One blocking generate call (on the worker thread)."""
        meta = dict(self.meta) | {"more_turns": True}
        caps = [r.max_tokens for r in group]
        out = self.generate(
            build_request([r.context for r in group], [r.seed for r in group], caps, meta)
        )
        self.calls += 1
        self.rows += len(group)
        return [
            Turn(list(ids), list(logprobs), str(reason), int(version))
            for ids, logprobs, reason, version in zip(
                out.column("response_tokens"),
                out.column("token_logprobs"),
                out.column("finish_reason"),
                out.tensor("weights_version").tolist(),
            )
        ]

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
