"""What keeps the agent server answering under a flood of connections from this machine.

- :class:`ConnectionGuard` caps the open connections. At the cap, a new connection closes
  the oldest one with no request in progress (first those that never finished a request's
  headers: a flood's), so a flood cannot hold every slot; when every connection has a
  request in progress the newcomer gets a 503 and is closed. The cap is the smaller of
  ``agent.server_max_connections`` and half the file descriptors this process has left
  (:func:`plan_connection_cap`), less bursts of :data:`BACKLOG` accepted at once: the
  other half is the run's own (its agents' client sockets, checkpoints, logs, Ray).
- :class:`RateLimitedLog` writes a repeated server failure (an ``accept()`` that ran out of
  descriptors, aiohttp's "Error handling request") once per interval to the driver's log,
  without its traceback and below the console's threshold, and counts the repeats.

The time allowed to send a request's headers is aiohttp's keep-alive timeout (it runs from
the connection's opening and from each response, and partial headers do not reset it); the
body's is a deadline around reading it (:mod:`rlframe.agent_server.app`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import socket
import time
from typing import Any

from aiohttp import web

logger = logging.getLogger("rlframe.agent_server")

BUSY_BODY = json.dumps(
    {
        "error": {
            "message": "the server holds its most connections, each with a request in progress",
            "type": "server_error",
            "param": None,
            "code": "overloaded",
        }
    }
).encode()
BUSY_REPLY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(BUSY_BODY), BUSY_BODY)
)


BACKLOG = 64
"""How many connections asyncio accepts at once before the guard sees any of them (and
closes the ones it evicts a loop turn later): the cap leaves room for three such bursts."""

LISTEN_QUEUE = 256
"""The kernel's queue of connections not yet accepted (capped by ``net.core.somaxconn``).
asyncio gives ``listen()`` the accept burst (:data:`BACKLOG`); with that queue, a step's
256 episodes connecting at once while the server's loop waits for the GIL overflowed it
(339 dropped handshakes in 4 steps of ``openai_agent_tiny``), and a dropped handshake is
retried after 1 s, 3 s..., past the client's 5 s connect timeout after three. It holds one
such step, and never more than the connection cap: a queue wider than the cap (4096 over
200, 256 over 64) fills with a local flood's connections ahead of legitimate ones, and an
accept burst past the cap then evicts those too before their requests are read (the flood
tests failed). Queued connections hold no descriptor of this process until accepted."""


def widen_listen_queue(listener: asyncio.base_events.Server, cap: int) -> None:
    """Give the listening sockets of ``listener`` the queue :data:`LISTEN_QUEUE`, at most
    ``cap`` (the connection cap) and at least :data:`BACKLOG`."""
    for transport_socket in listener.sockets:
        # A duplicate descriptor of the same socket: listen() on it sets the socket's queue.
        with socket.fromfd(
            transport_socket.fileno(), transport_socket.family, transport_socket.type
        ) as sock:
            sock.listen(max(BACKLOG, min(LISTEN_QUEUE, cap)))


def count_open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64  # no /proc: a modest guess


def plan_connection_cap(configured: int) -> int:
    """The connection cap: ``configured``, or half the descriptors this process has left
    under its soft limit if that is less (at least 8, so the run's own agents can still
    connect)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(8, min(configured, (soft - count_open_fds() - 3 * BACKLOG) // 2))


class Refused(asyncio.Protocol):
    """A connection past the cap while every held one is busy: a 503, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(BUSY_REPLY)
        transport.close()


class ConnectionGuard:
    """The protocol factory of the server's socket: aiohttp's handlers, at most ``cap`` open.

    ``busy`` and ``served`` are kept by the server's middleware (:meth:`request_started`,
    :meth:`request_done`): connections with a request in progress are never closed here."""

    def __init__(self, server: web.Server, cap: int) -> None:
        self.server, self.cap = server, cap
        self.busy: set[web.RequestHandler] = set()
        self.served: set[web.RequestHandler] = set()
        self.evicted = 0
        self.refused = 0

    def request_started(self, protocol: web.RequestHandler) -> None:
        self.busy.add(protocol)

    def request_done(self, protocol: web.RequestHandler) -> None:
        self.busy.discard(protocol)
        self.served.add(protocol)

    def __call__(self) -> asyncio.BaseProtocol:
        connections = self.server.connections
        if len(connections) >= self.cap:
            alive = [c for c in connections if c.transport is not None]
            self.served &= set(alive)  # forget connections that are gone
            if len(alive) >= self.cap and not self.evict(alive):
                self.refused += 1
                return Refused()
        return self.server()

    def evict(self, alive: list[web.RequestHandler]) -> bool:
        """Close the oldest idle connection, one that never finished headers first."""
        idle = [c for c in alive if c not in self.busy]
        never_served = [c for c in idle if c not in self.served]
        victims = never_served or idle
        if not victims:
            return False
        victims[0].force_close()
        self.evicted += 1
        return True


class RateLimitedLog:
    """Writes each kind of repeated failure at most once per ``interval_s``, as INFO (the
    driver's log, not the console) and without a traceback, with the count since."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self.last: dict[str, float] = {}
        self.repeats: dict[str, int] = {}

    def note(self, kind: str, detail: str) -> bool:
        """Log ``kind`` unless it was logged less than ``interval_s`` ago; whether it was."""
        now = time.monotonic()
        if now - self.last.get(kind, -self.interval_s) < self.interval_s:
            self.repeats[kind] = self.repeats.get(kind, 0) + 1
            return False
        repeats = self.repeats.pop(kind, 0)
        since = f" ({repeats} more since the last such line)" if repeats else ""
        logger.info("agent server: %s: %s%s", kind, detail[:300], since)
        self.last[kind] = now
        return True

    def loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """The server loop's exception handler (``accept()`` out of descriptors...)."""
        error = context.get("exception")
        detail = f"{type(error).__name__}: {error}" if error is not None else ""
        self.note(str(context.get("message", "event loop error")), detail)


class QuietAiohttp(logging.Filter):
    """On aiohttp's loggers: a bad request's "Error handling request" and its traceback go
    to :class:`RateLimitedLog` instead of the console."""

    def __init__(self, log: RateLimitedLog) -> None:
        super().__init__()
        self.log = log

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        detail = f"{type(error).__name__}: {error}" if error is not None else ""
        self.log.note(record.getMessage(), detail)
        return False
