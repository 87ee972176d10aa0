"""A :class:`~rlframe.rollout.turns.TurnServer` over a blocking batch ``generate``.

For an engine reached by one call per batch of rows (``Batch -> Batch``, the wire of
:mod:`rlframe.rollout.rows`) rather than by the request stream: scripted engines in tests, or
a group whose workers have no ``serve``. One driver thread makes the calls; the requests that
wait when a call ends go out together in the next one (requests with another temperature or
other stop ids wait for a call of their own), so nothing waits for a batching window.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from rlframe.core.protocol import ROUTED_EXPERTS, Batch
from rlframe.rollout.rows import build_request
from rlframe.rollout.turns import TurnRequest, TurnResult, settle

Waiting = tuple[TurnRequest, Future[TurnResult]]


class BatchedTurns:
    """Args:
    generate: one turn for each row of a request Batch (meta ``stop_token_ids``).
    open_stream: what makes the engines ready for a generation phase (none by default).
    """

    def __init__(
        self, generate: Callable[[Batch], Batch], open_stream: Callable[[], object] = lambda: None
    ) -> None:
        self.generate, self.open_stream = generate, open_stream
        self.lock = threading.Lock()
        self.work = threading.Condition(self.lock)
        self.queue: list[Waiting] = []
        self.closed = False
        self.calls = 0
        self.requests = 0
        self.thread = threading.Thread(target=self.run, daemon=True, name="rlframe-turn-calls")
        self.thread.start()

    def open(self) -> None:
        self.open_stream()

    def submit(self, request: TurnRequest, session: str) -> Future[TurnResult]:
        future: Future[TurnResult] = Future()
        with self.lock:
            if self.closed:
                future.set_exception(RuntimeError("the turn server closed"))
                return future
            self.queue.append((request, future))
            self.work.notify_all()
        return future

    def end_session(self, session: str) -> None:
        """Nothing is kept per session: every call goes to the one engine entry."""

    def take_metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.work.notify_all()
            waiting, self.queue = self.queue, []
        for _, future in waiting:
            settle(future, error=RuntimeError("the turn server closed"))

    def run(self) -> None:
        while True:
            with self.lock:
                while not (self.queue or self.closed):
                    self.work.wait()
                if self.closed:
                    return
                batch, self.queue = take_alike(self.queue)
            try:
                results = self.call([r for r, _ in batch])
            except Exception as error:  # every request of the call gets the engine's error
                for _, future in batch:
                    settle(future, error=error)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                settle(future, result)

    def call(self, requests: list[TurnRequest]) -> list[TurnResult]:
        """One blocking ``generate`` over ``requests`` (alike in temperature and stop ids)."""
        first = requests[0]
        meta: dict[str, object] = {"stop_token_ids": list(first.stop_ids), "more_turns": True}
        if first.temperature == 0:
            meta["greedy"] = True
        elif first.temperature is not None:
            meta["temperature"] = first.temperature
        images = [list(r.images) for r in requests]
        out = self.generate(
            build_request(
                [r.context for r in requests],
                [r.seed for r in requests],
                [r.max_tokens for r in requests],
                meta,
                images if any(images) else None,
            )
        )
        self.calls += 1
        self.requests += len(requests)
        routing = out.column(ROUTED_EXPERTS) if ROUTED_EXPERTS in out else [None] * len(requests)
        return [
            TurnResult(
                r.request_id, list(ids), list(logprobs), str(reason), int(version), -1, experts
            )
            for r, ids, logprobs, reason, version, experts in zip(
                requests,
                out.column("response_tokens"),
                out.column("token_logprobs"),
                out.column("finish_reason"),
                out.tensor("weights_version").tolist(),
                routing,
                strict=True,
            )
        ]


def take_alike(queue: list[Waiting]) -> tuple[list[Waiting], list[Waiting]]:
    """The requests one call can carry (the first one's temperature and stop ids), and the
    rest, in arrival order."""
    first = queue[0][0]

    def key(r: TurnRequest) -> tuple[float | None, tuple[int, ...]]:
        return (r.temperature, r.stop_ids)

    batch = [w for w in queue if key(w[0]) == key(first)]
    rest = [w for w in queue if key(w[0]) != key(first)]
    return batch, rest
