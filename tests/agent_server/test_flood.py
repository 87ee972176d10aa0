"""The endpoint under abuse from this machine: slow headers and bodies time out, and a flood
of unfinished connections from another local process (loopback only, bounded in count and
time), past the file descriptors this process has left, neither exhausts them nor keeps
legitimate calls out. The servers run over the tiny model's real engine (transformers),
not in a training run."""

from __future__ import annotations

import logging
import resource
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from rlframe.agent_server.app import AgentServer
from rlframe.agent_server.guard import RateLimitedLog, count_open_fds
from rlframe.data.tiny_model import resolve_model_path
from rlframe.rollout.engine_client import EngineClient
from tests.agent_server.conftest import Served, make_config
from tests.flood import FLOOD
from workers.roles.rollout_role import RolloutRole

USER = [{"role": "user", "content": "1+1=?"}]
FD_HEADROOM = 400
"""The descriptors the test leaves this process above those it has open: a flood past them
would starve its own client sockets without the server's cap (about 100 here)."""


@pytest.fixture(scope="module")
def engine() -> tuple[RolloutRole, Any]:
    """The tiny model's rollout role (the costly part) and its tokenizer, for the servers."""
    from transformers import AutoTokenizer

    path = resolve_model_path("tiny:0")
    return RolloutRole(make_config(), path, "cpu", 0), AutoTokenizer.from_pretrained(path)


@contextmanager
def started(engine: tuple[RolloutRole, Any], **agent: Any) -> Iterator[Served]:
    role, tokenizer = engine
    server = AgentServer(make_config(**agent), EngineClient([role.serve]), tokenizer, "tiny")
    server.sample_like({"stop_token_ids": [tokenizer.eos_token_id]})
    try:
        server.start()
        yield Served(server, tokenizer)
    finally:
        server.stop()


@contextmanager
def few_descriptors_left(headroom: int) -> Iterator[None]:
    """A soft limit on open files ``headroom`` above what this process holds, restored."""
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (count_open_fds() + headroom, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)


def wait_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """What the server sent before closing the connection, and after how long."""
    start, got = time.monotonic(), b""
    sock.settimeout(limit_s)
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return got, time.monotonic() - start
        got += chunk


def test_unfinished_headers_and_bodies_time_out(engine: tuple[RolloutRole, Any]) -> None:
    with started(engine, server_header_timeout_s=1.0, server_body_timeout_s=1.0) as served:
        check_timeouts(served)


def check_timeouts(guarded: Served) -> None:
    port = guarded.server.port
    with socket.create_connection(("127.0.0.1", port)) as slow:
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        got, waited = wait_closed(slow, 10)
    assert got == b"" and 0.5 < waited < 5
    key = guarded.open().key
    with socket.create_connection(("127.0.0.1", port)) as slow:
        slow.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode()
        )
        got, waited = wait_closed(slow, 10)
    assert got.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in got, got[:200]
    assert 0.5 < waited < 5


def test_a_local_flood_leaves_legitimate_calls_answered(
    engine: tuple[RolloutRole, Any],
) -> None:
    with few_descriptors_left(FD_HEADROOM), started(engine) as served:
        check_flood(served)


def check_flood(guarded: Served) -> None:
    server = guarded.server
    assert server.guard is not None and 50 < server.guard.cap <= FD_HEADROOM // 2
    # The flood lasts until the legitimate calls are done (its stop file), at most 30 s: on a
    # loaded machine a fixed 6 s was sometimes too short to open past FD_HEADROOM.
    stop = Path(tempfile.mkdtemp()) / "stop"
    flood = subprocess.Popen(
        [sys.executable, "-c", FLOOD, str(server.port), str(FD_HEADROOM + 300), "30"]
        + [str(FD_HEADROOM), str(stop)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert flood.stdout is not None
        ready, _, _ = select.select([flood.stdout], [], [], 20)
        assert ready and flood.stdout.readline().strip() == "past", "the flood did not get going"
        answered: list[Any] = []
        for _ in range(4):  # an episode's first call each, as the run's agents make them
            client = OpenAI(base_url=server.base_url, api_key=guarded.open().key, max_retries=2)
            reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=1)
            answered.append(reply.choices[0].message.role)
            client.close()
            assert count_open_fds() < resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 50
        stop.touch()
        opened = int(flood.communicate(timeout=40)[0].strip() or 0)
    finally:
        flood.kill()
        flood.wait()
    assert answered == ["assistant"] * 4
    assert opened > FD_HEADROOM, "the flood should have gone past what the process could hold"
    assert server.guard.evicted > 0  # the rest ran out of time for their headers


def test_repeated_server_failures_reach_the_log_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = RateLimitedLog(interval_s=60)
    context = {"message": "socket.accept() out of system resource", "exception": OSError(24)}
    with caplog.at_level(logging.INFO, logger="rlframe.agent_server"):
        for _ in range(1000):
            log.loop_exception(None, context)  # type: ignore[arg-type]
    lines = [r for r in caplog.records if r.name == "rlframe.agent_server"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and not lines[0].exc_info
    assert "socket.accept() out of system resource" in lines[0].getMessage()
    assert log.repeats["socket.accept() out of system resource"] == 999


def test_a_burst_of_connections_is_queued_while_the_loop_is_busy(
    engine: tuple[RolloutRole, Any],
) -> None:
    """A step's episodes connect at once while the server's loop may wait (for the GIL, for a
    long request): the kernel queues every handshake, where a queue of 64 dropped the rest,
    which their clients retried after 1 s, 3 s... and gave up on after 5 s."""
    burst = 250
    with started(engine) as served:
        loop = served.server.loop
        loop.call_soon_threadsafe(time.sleep, 2.0)  # the loop accepts nothing for 2 s
        time.sleep(0.1)
        sockets = [socket.socket() for _ in range(burst)]
        try:
            for sock in sockets:
                sock.setblocking(False)
                sock.connect_ex(("127.0.0.1", served.server.port))
            # A handshake the kernel queued is complete: the socket is writable.
            deadline, pending = time.monotonic() + 0.8, set(sockets)
            while pending and time.monotonic() < deadline:
                _, writable, _ = select.select([], list(pending), [], 0.05)
                pending -= set(writable)
            assert not pending, f"{len(pending)} of {burst} handshakes not done within 0.8 s"
        finally:
            for sock in sockets:
                sock.close()
