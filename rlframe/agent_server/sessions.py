"""Sessions: one per episode, keyed by the episode's own API key.

The agent of an episode gets ``base_url`` (the server's ``/v1``) and ``api_key`` (the
session's key); every call it makes with that key lands in that episode's rows, so
concurrent episodes never mix. A key is live from :meth:`SessionRegistry.open` until the
episode ends (:meth:`SessionRegistry.close`); calls with an unknown or closed key get 401.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

from rlframe.agent_server.trajectory import Episode


@dataclass
class Session:
    key: str
    sample: dict[str, Any]
    episode: Episode
    seed: int
    """The prompt row's seed; call k samples with ``mix_seed(seed, k)``."""
    calls: int = 0
    closed: bool = False
    in_flight: int = field(default=0)


class SessionRegistry:
    """Thread-safe: episodes open and close on the producer's thread, calls arrive on the
    server's event loop."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sessions: dict[str, Session] = {}

    def open(self, sample: dict[str, Any], seed: int, episode: Episode) -> Session:
        session = Session("sk-rlframe-" + secrets.token_hex(12), sample, episode, seed)
        with self.lock:
            self.sessions[session.key] = session
        return session

    def get(self, key: str) -> Session | None:
        with self.lock:
            return self.sessions.get(key)

    def close(self, key: str) -> None:
        """End a session (again: nothing happens)."""
        with self.lock:
            session = self.sessions.pop(key, None)
        if session is not None:
            session.closed = True

    def count(self) -> int:
        with self.lock:
            return len(self.sessions)
