"""The request stream's driver side without Ray: each replica's ``serve`` is a scripted
engine here (the real one is ``RolloutRole.serve``, tested in tests/ray/test_multi_turn.py
and tests/agent_server): routing, continuous batching across calls, failures."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from rlframe.rollout.engine_client import EngineClient
from rlframe.rollout.turns import TurnRequest, TurnResult


class ScriptedEngine:
    """Finishes each request ``steps`` calls after it arrived, answering its context's
    length as the one sampled id; records every call's new request ids."""

    def __init__(self, rank: int, steps: int = 1) -> None:
        self.rank, self.steps = rank, steps
        self.running: dict[str, tuple[TurnRequest, int]] = {}
        self.calls: list[list[str]] = []
        self.fail_next = False
        self.gate = threading.Event()
        self.gate.set()

    def serve(self, requests: list[TurnRequest]) -> list[TurnResult]:
        self.gate.wait(10)
        self.calls.append([r.request_id for r in requests])
        for r in requests:
            self.running[r.request_id] = (r, self.steps)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("actor worker rank 1 failed in serve(): boom")
        done = []
        for rid, (r, left) in list(self.running.items()):
            if left <= 1:
                del self.running[rid]
                done.append(
                    TurnResult(rid, [len(r.context)], [-0.5], "stop", 0, 0, None, self.rank)
                )
            else:
                self.running[rid] = (r, left - 1)
        return done


def request(n: int) -> TurnRequest:
    return TurnRequest(list(range(n)), seed=n, max_tokens=1, stop_ids=(2,))


def test_a_session_stays_on_its_replica_and_new_ones_go_to_the_least_loaded() -> None:
    engines = [ScriptedEngine(0), ScriptedEngine(1)]
    client = EngineClient([e.serve for e in engines])
    try:
        engines[0].gate.clear()  # replica 0 is busy with a's request: b goes to replica 1
        first = client.submit(request(3), "a")
        second = client.submit(request(4), "b")
        engines[0].gate.set()
        assert first.result(10).rank == 0 and second.result(10).rank == 1
        for turn in range(3):  # later turns follow their session, whatever the load
            assert client.submit(request(5 + turn), "a").result(10).rank == 0
            assert client.submit(request(5 + turn), "b").result(10).rank == 1
        metrics = client.take_metrics()
        assert metrics["rollout/requests/replica_0"] == metrics["rollout/requests/replica_1"] == 4
        client.end_session("a")
        assert client.replica_of("a") is None and client.replica_of("b") == 1
    finally:
        client.close()


def test_requests_arriving_during_a_call_join_the_next_one() -> None:
    engine = ScriptedEngine(0, steps=3)
    client = EngineClient([engine.serve])
    try:
        engine.gate.clear()
        first = client.submit(request(3), "a")
        deadline = time.monotonic() + 10
        while not client.replicas[0].waiting and time.monotonic() < deadline:
            time.sleep(0.01)  # until the first call is in flight (held at the gate)
        late = [client.submit(request(4 + k), f"s{k}") for k in range(3)]
        engine.gate.set()
        results = [f.result(10) for f in [first, *late]]
        assert [r.ids for r in results] == [[3], [4], [5], [6]]
        # The late requests went out together in the next call, while the first still ran.
        assert [len(call) for call in engine.calls[:2]] == [1, 3]
        assert sum(len(call) for call in engine.calls) == 4
    finally:
        client.close()


def test_a_failed_call_fails_its_requests_and_the_stream_goes_on() -> None:
    engine = ScriptedEngine(0, steps=2)
    client = EngineClient([engine.serve])
    try:
        engine.fail_next = True
        failed: Future[TurnResult] = client.submit(request(3), "a")
        with pytest.raises(RuntimeError, match="rank 1 failed in serve"):
            failed.result(10)
        # The engine still finishes the given-up request later: nobody waits, nothing breaks.
        assert client.submit(request(7), "b").result(10).ids == [7]
        assert engine.running == {}
    finally:
        client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.submit(request(3), "c").result(1)
