"""The driver's side of the request stream: turns in, one at a time, from any episode.

Each engine replica (one rollout rank, or the ranks of one tensor-parallel group) has a
:class:`ReplicaPump`: a driver thread that keeps one ``serve`` call in flight on it while
requests wait or run there. A call hands the engine every request that arrived since the last
one and returns as soon as an engine step finishes some (``RolloutRole.serve``), so a request
joins the running batch within one call and leaves it when done: continuous batching across
one Ray RPC per few engine steps, not one per request.

Routing: a session (an episode) stays on the replica that served its first request, where its
prefix is cached; a new session goes to the least-loaded replica (fewest requests in flight,
then fewest live sessions). The client is thread-safe: episodes on any event loop (the agents'
``asyncio.run``, the ``openai`` server's loop) await
:func:`rlframe.rollout.turns.sample_turn` on it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from rlframe.controller.worker_group import CallHandle
from rlframe.rollout.turns import ABORTED, TurnRequest, TurnResult, settle


@dataclass
class ReplicaStats:
    """One replica's counters since the last :meth:`EngineClient.take_metrics`."""

    requests: int = 0
    calls: int = 0
    in_flight_sum: int = 0
    """Requests in flight at each call, summed (over ``calls``: the mean)."""
    context_tokens: int = 0
    cached_tokens: int = 0
    """Context tokens of requests whose engine reports its prefix-cache hits, and the hits."""


Serve = Callable[[list[TurnRequest]], list[TurnResult]]
"""One ``serve`` call on an engine replica (blocking): new requests in, finished ones out. A
``serve`` with an ``abort`` attribute (:class:`RayReplica`) can also end what it holds
part-way (:meth:`EngineClient.pause`); one without finishes every request it is handed in
that call (:func:`~rlframe.rollout.batched_turns.serve_by_generate`)."""

Abort = Callable[[], list[TurnResult]]
"""End every request a replica holds, now: each with what it sampled so far."""


@dataclass
class RayReplica:
    """One engine replica of a worker group: ranks ``ranks`` (a tensor-parallel group step
    alike, so each call goes to every one of them and the first rank's results are kept).
    A call that fails raises the WorkerError naming the rank (``rollout worker rank 1 failed
    in serve()``), or that it did not answer within ``timeout_s``."""

    role: str
    actors: list[Any]
    ranks: list[int]
    timeout_s: float

    def __call__(self, requests: list[TurnRequest]) -> list[TurnResult]:
        return self.call("serve", requests)

    def abort(self) -> list[TurnResult]:
        """Every rank's ``abort_stream`` (``RolloutRole.abort_stream``)."""
        return self.call("abort_stream")

    def call(self, method: str, *args: Any) -> list[TurnResult]:
        refs = {getattr(self.actors[rank], method).remote(*args): rank for rank in self.ranks}
        results: list[TurnResult] = CallHandle(
            self.role, method, refs, self.timeout_s, self.actors
        ).result()[0]
        return results


def connect_ray_replicas(
    role: str, actors: list[Any], tp: int, timeout_s: float
) -> list[RayReplica]:
    """A replica per tensor-parallel group of a worker group: ranks ``[g*tp, (g+1)*tp)``
    hold replica ``g``."""
    return [
        RayReplica(role, actors, list(range(g * tp, (g + 1) * tp)), timeout_s)
        for g in range(len(actors) // tp)
    ]


@dataclass
class ReplicaPump:
    """One engine replica: its ``serve``, its queue and the thread that serves it."""

    index: int
    serve: Serve
    client: EngineClient
    queue: list[tuple[TurnRequest, Future[TurnResult]]] = field(default_factory=list)
    waiting: dict[str, tuple[Future[TurnResult], int]] = field(default_factory=dict)
    """Requests handed to the engine and not finished, by id, with their context lengths."""
    sessions: int = 0
    stats: ReplicaStats = field(default_factory=ReplicaStats)
    thread: threading.Thread | None = None
    busy: bool = False
    """A ``serve`` call is running (:meth:`EngineClient.pause` waits for it to return)."""

    @property
    def in_flight(self) -> int:
        return len(self.queue) + len(self.waiting)

    def start(self) -> None:
        name = f"rlframe-engine-replica-{self.index}"
        self.thread = threading.Thread(target=self.run, daemon=True, name=name)
        self.thread.start()

    def run(self) -> None:
        client = self.client
        while True:
            with client.lock:
                while not client.closed and (client.paused or not (self.queue or self.waiting)):
                    client.work.wait()
                if client.closed:
                    return
                batch, self.queue = self.queue, []
                for request, future in batch:
                    self.waiting[request.request_id] = (future, len(request.context))
                self.stats.calls += 1
                self.stats.in_flight_sum += len(self.waiting)
                self.busy = True
            try:
                results = self.serve([request for request, _ in batch])
            except Exception as error:  # the call's failure reaches every request it carried
                self.fail_all(error)
                continue
            self.finish(results)

    def finish(self, results: list[TurnResult]) -> None:
        with self.client.lock:
            self.busy = False
            self.client.work.notify_all()
            # A request an earlier failed call gave up on may still finish: nobody waits.
            done = [
                (self.waiting.pop(r.request_id), r) for r in results if r.request_id in self.waiting
            ]
            for (_, context), r in done:
                self.stats.requests += 1
                if r.cached_tokens >= 0:
                    self.stats.cached_tokens += r.cached_tokens
                    self.stats.context_tokens += context
        for (future, _), result in done:
            settle(future, result)

    def abort(self) -> None:
        """End what this replica holds (the client is paused and no call runs): requests
        in the engine with their tokens so far, queued ones with none."""
        abort: Abort | None = getattr(self.serve, "abort", None)
        try:
            results = abort() if abort is not None and self.waiting else []
        except Exception as error:
            self.fail_all(error)
            return
        self.finish(results)
        with self.client.lock:
            left = [(r.request_id, f) for r, f in self.queue]
            left += [(request_id, f) for request_id, (f, _) in self.waiting.items()]
            self.queue, self.waiting = [], {}
        for request_id, future in left:
            settle(future, TurnResult(request_id, [], [], ABORTED, -1))

    def fail_all(self, error: Exception) -> None:
        with self.client.lock:
            self.busy = False
            self.client.work.notify_all()
            futures = [f for f, _ in self.waiting.values()] + [f for _, f in self.queue]
            self.waiting, self.queue = {}, []
        for future in futures:
            settle(future, error=error)


class EngineClient:
    """Args:
    replicas: each engine replica's ``serve`` (:func:`connect_ray_replicas` for a worker
        group; an in-process ``RolloutRole.serve`` in tests).
    open_stream: puts every rank's engine in rollout mode (the group's ``open_stream``).
    """

    def __init__(
        self, replicas: Sequence[Serve], open_stream: Callable[[], object] = lambda: None
    ) -> None:
        self.open_stream = open_stream
        self.lock = threading.Lock()
        self.work = threading.Condition(self.lock)
        self.closed = False
        self.paused = False
        """Between :meth:`pause` and :meth:`resume`: no ``serve`` call starts."""
        self.routes: dict[str, ReplicaPump] = {}
        """Session -> the replica that serves it."""
        self.ids = itertools.count()
        self.replicas = [ReplicaPump(g, serve, self) for g, serve in enumerate(replicas)]
        for replica in self.replicas:
            replica.start()

    # -- requests --------------------------------------------------------------------------

    def open(self) -> None:
        """Wake every engine for a generation phase (blocking): before an agent's episodes."""
        self.open_stream()

    def submit(self, request: TurnRequest, session: str) -> Future[TurnResult]:
        """Queue ``request`` on ``session``'s replica; its future result (thread-safe)."""
        future: Future[TurnResult] = Future()
        with self.lock:
            if self.closed:
                future.set_exception(RuntimeError("the engine client closed"))
                return future
            replica = self.route(session)
            request = replace(request, request_id=f"{next(self.ids)}")
            replica.queue.append((request, future))
            self.work.notify_all()
        return future

    def pause(self) -> None:
        """Stop the stream for a weight sync (blocking): no call starts; the calls running
        return; then every request in flight ends now, its future answered with what it
        sampled so far (finish reason ``abort``, the version that sampled it; a request
        still queued: no tokens, version -1). Sessions keep their replicas. Requests
        submitted meanwhile wait for :meth:`resume`."""
        with self.lock:
            self.paused = True
            while any(r.busy for r in self.replicas):
                self.work.wait()
        for replica in self.replicas:
            replica.abort()

    def resume(self) -> None:
        """Serve again after :meth:`pause`."""
        with self.lock:
            self.paused = False
            self.work.notify_all()

    def route(self, session: str) -> ReplicaPump:
        """The session's replica; a new session goes to the least-loaded one (lock held)."""
        replica = self.routes.get(session)
        if replica is None:
            replica = min(self.replicas, key=lambda r: (r.in_flight, r.sessions, r.index))
            self.routes[session] = replica
            replica.sessions += 1
        return replica

    def end_session(self, session: str) -> None:
        """The session is over: its replica no longer counts it."""
        with self.lock:
            replica = self.routes.pop(session, None)
            if replica is not None:
                replica.sessions -= 1

    def replica_of(self, session: str) -> int | None:
        """The index of the replica serving ``session`` (None: no request yet)."""
        with self.lock:
            replica = self.routes.get(session)
            return None if replica is None else replica.index

    # -- metrics and shutdown ----------------------------------------------------------------

    def take_metrics(self) -> dict[str, float]:
        """Since the last call: ``rollout/prefix_cache_hit`` (the share of request context
        tokens the engines' prefix caches held, where they report it) and per replica
        ``rollout/requests/replica_<g>`` and ``rollout/in_flight/replica_<g>`` (the mean
        requests in flight at its calls)."""
        with self.lock:
            stats = [r.stats for r in self.replicas]
            for r in self.replicas:
                r.stats = ReplicaStats()
        if not any(s.requests for s in stats):
            return {}
        metrics: dict[str, float] = {}
        context = sum(s.context_tokens for s in stats)
        if context:
            metrics["rollout/prefix_cache_hit"] = sum(s.cached_tokens for s in stats) / context
        for g, s in enumerate(stats):
            metrics[f"rollout/requests/replica_{g}"] = float(s.requests)
            metrics[f"rollout/in_flight/replica_{g}"] = s.in_flight_sum / max(s.calls, 1)
        return metrics

    def close(self) -> None:
        """Stop the pumps; requests still waiting fail."""
        with self.lock:
            self.closed = True
            self.work.notify_all()
        for replica in self.replicas:
            replica.fail_all(RuntimeError("the engine client closed"))
