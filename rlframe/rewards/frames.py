"""Length-prefixed pickle frames: how the reward pool and its worker processes talk over pipes."""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any

HEADER = struct.Struct("!Q")


def write_frame(fd: int, message: Any) -> None:
    """Write one message to the file descriptor ``fd`` (blocking until all of it is written)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def read_exact(fd: int, size: int) -> bytes | None:
    """``size`` bytes from ``fd``, or None if the other end closed first."""
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> tuple[bool, Any]:
    """(True, message), or (False, None) when the other end closed."""
    header = read_exact(fd, HEADER.size)
    if header is None:
        return False, None
    body = read_exact(fd, HEADER.unpack(header)[0])
    if body is None:
        return False, None
    return True, pickle.loads(body)
