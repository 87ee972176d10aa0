"""Single-turn responses as requests of the engines' stream, ahead of the trainer.

At ``rollout.max_staleness >= 1`` (with ``rollout.partial_chunk_tokens=0``) every unfinished
response of the producer's groups is one request in the stream
(:class:`~rlframe.rollout.engine_client.EngineClient`): it joins an engine's running batch
at once and leaves it when done, while the trainer trains (separate placement) or until the
step's groups are finished (colocated). A weight sync, or a colocated step taking its batch,
pauses the stream (:meth:`ResponseStream.pause`): every request in flight ends where it is,
its tokens kept with the version that sampled them. The next :meth:`ResponseStream.submit`
continues each as a new request (the prompt and the kept tokens, with what is left of
``rollout.max_tokens``) on the weights the engine then holds: a partial rollout by abort and
continuation, as AReaL and slime do, with nothing of the engine beyond ``add_request``,
``step`` and ``abort``.

What this changes: how far a response got before a sync depends on the trainer's timing,
so a run at ``max_staleness >= 1`` samples differently from one run to the next and resumes
to the tolerance of sampling, not bit for bit; ``rollout.partial_chunk_tokens > 0`` keeps
the fixed-size calls (:mod:`rlframe.rollout.partial`), which are reproducible.

Under ``algorithm.router_replay=rollout`` a response must carry one routing of all its tokens,
so responses are sampled whole there (the producer's calls, no stream).
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from functools import partial
from queue import SimpleQueue

from rlframe.rollout.engine_client import EngineClient
from rlframe.rollout.partial import continuation_seed
from rlframe.rollout.rows import TokenRow, add_turn_result
from rlframe.rollout.turns import ABORTED, TurnRequest, TurnResult


class ResponseStream:
    """Args:
    client: the policy's engines.
    max_tokens: a response's budget (``rollout.max_tokens``), over all its requests.
    stop_ids: the tokens that end a response.
    """

    def __init__(self, client: EngineClient, max_tokens: int, stop_ids: tuple[int, ...]) -> None:
        self.client, self.max_tokens, self.stop_ids = client, max_tokens, stop_ids
        self.in_flight: dict[int, tuple[TokenRow, Future[TurnResult], str]] = {}
        """Requests not answered yet, by ``id`` of their row, with the row's session."""
        self.answered: SimpleQueue[int] = SimpleQueue()
        """Keys of ``in_flight`` whose future is done, in the order answered (put by the
        futures' callbacks, on the engine client's threads): no scan of what is in flight."""
        self.sessions = (f"response-{i}" for i in itertools.count())
        self.open = False
        """The engines were opened for requests since the last pause."""
        self.busy_since: float | None = None
        self.busy_s = 0.0
        """Seconds some request was in flight, since the last :meth:`take_busy_s`."""

    def submit(self, rows: list[TokenRow]) -> None:
        """A request for each unfinished row of ``rows`` that has none in flight."""
        new = [r for r in rows if r.finish_reason is None and id(r) not in self.in_flight]
        if not new:
            return
        if not self.open:  # a colocated engine sleeps since the trainer's last pass
            self.client.open()
            self.open = True
        if self.busy_since is None:
            self.busy_since = time.perf_counter()
        for row in new:
            request = TurnRequest(
                row.context,
                continuation_seed(row),
                self.max_tokens - len(row.response_ids),
                self.stop_ids,
                images=tuple(row.images),
            )
            session = next(self.sessions)
            future = self.client.submit(request, session)
            self.in_flight[id(row)] = (row, future, session)
            future.add_done_callback(partial(self.note_answer, id(row)))

    def note_answer(self, key: int, _: Future[TurnResult]) -> None:
        self.answered.put(key)

    def wait(self) -> list[TokenRow]:
        """Block until some request is answered; the rows that finished (none if every
        answer was an abort)."""
        if not self.in_flight:
            raise RuntimeError("the response stream has nothing in flight to wait for")
        return self.take_answered([self.answered.get()])

    def pause(self) -> None:
        """End every request in flight where it is (the engines hold none after) and keep
        what each sampled: before a weight sync, and before a colocated engine sleeps."""
        if self.in_flight:
            self.client.pause()
            self.client.resume()
            self.take_answered()
        self.open = False

    def take_answered(self, keys: list[int] | None = None) -> list[TokenRow]:
        """Merge every answer received (``keys``: some taken from :attr:`answered` already);
        the rows that finished."""
        keys = keys or []
        while not self.answered.empty():
            keys.append(self.answered.get())
        finished = []
        for key in keys:
            row, future, session = self.in_flight.pop(key)
            self.client.end_session(session)
            if self.add_answer(row, future.result()):
                finished.append(row)
        if not self.in_flight and self.busy_since is not None:
            self.busy_s += time.perf_counter() - self.busy_since
            self.busy_since = None
        return finished

    def add_answer(self, row: TokenRow, result: TurnResult) -> bool:
        """Append an answer's tokens to ``row``; whether the response is complete (a stop
        token, or ``max_tokens`` in all)."""
        if result.finish_reason == ABORTED:
            if result.ids:
                row.add_turn(result.ids, result.logprobs, ABORTED, result.weights_version)
            row.finish_reason = None
            return False
        add_turn_result(row, result)
        return True

    def take_busy_s(self) -> float:
        """Seconds the engines had requests of this stream since the last call."""
        busy, self.busy_s = self.busy_s, 0.0
        if self.busy_since is not None:
            now = time.perf_counter()
            busy, self.busy_since = busy + now - self.busy_since, now
        return busy
