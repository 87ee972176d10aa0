"""Ctrl-C and SIGTERM: stop in seconds, say where the run stands, exit 130 / 143.

The first SIGINT or SIGTERM raises :class:`Interrupted` in the driver's main thread (a
``BaseException``, so no ``except Exception`` on the way swallows it; inside a Ray call it
arrives wrapped in a ``SystemError``, see :func:`find_interruption`); the launcher's
``finally`` blocks then stop the workers and Ray in order, and :mod:`rlframe.main` prints one
line and exits with 128 + the signal number, as shells do. A second signal while that
teardown runs exits at once. Ray installs its own SIGTERM handler when it starts (it exits
through a path that can abort with a C++ stack dump), so the launcher installs ours again
after Ray is up.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from rlframe.state.checkpoint import read_driver_state
from rlframe.state.checkpoint_layout import find_latest_checkpoint


class Interrupted(BaseException):
    """The driver received SIGINT or SIGTERM."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


RECEIVED: list[int] = []


def find_interruption(error: BaseException) -> Interrupted | None:
    """The :class:`Interrupted` behind ``error``, or the signal received before it. A signal
    that arrives while the driver waits inside Ray (``ray.wait``/``ray.get``, as during worker
    start-up) runs our handler from Ray's compiled code, which hands the exception back as the
    cause of a ``SystemError``. One that arrives inside a library that swallows it (a bare
    ``except`` around an import) can leave that import half done, and a later import fails
    for it: every failure after a signal is the signal's."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, Interrupted):
            return current
        current = current.__cause__ or current.__context__
    return find_received()


def find_received() -> Interrupted | None:
    """The :class:`Interrupted` of the first signal received, or None."""
    return Interrupted(RECEIVED[0]) if RECEIVED else None


def raise_if_interrupted() -> None:
    """Raise the :class:`Interrupted` of a signal received meanwhile whose exception did not
    arrive (a library swallowed it): called between the launcher's phases, so that such a run
    still stops at the next one instead of going on."""
    received = find_received()
    if received is not None:
        raise received


def handle_signal(signum: int, frame: FrameType | None) -> None:
    if RECEIVED:  # a second signal during the teardown: stop now
        print(f"rlframe: {signal.Signals(signum).name} again: exiting now", file=sys.stderr)
        os._exit(128 + signum)
    RECEIVED.append(signum)
    raise Interrupted(signum)


def install_interrupt_handlers() -> None:
    """Route SIGINT and SIGTERM to :class:`Interrupted` (main thread only, as Python requires)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handle_signal)


def last_logged_step(output_dir: Path) -> int:
    metrics = output_dir / "metrics.jsonl"
    if not metrics.is_file():
        return 0
    lines = metrics.read_text().strip().splitlines()
    try:
        return int(json.loads(lines[-1])["step"]) if lines else 0
    except (ValueError, KeyError, TypeError):
        return 0


def describe_position(output_dir: str | Path) -> tuple[str, str]:
    """Where a run that stops now stands: (``at step N`` or ``before step 1 finished``, how
    it resumes: from its latest checkpoint, from the start, or in a new folder)."""
    out = Path(output_dir)
    step = last_logged_step(out) + 1
    latest = find_latest_checkpoint(out) if out.is_dir() else None
    try:
        saved = None if latest is None else int(read_driver_state(latest)["step"])
    except (OSError, ValueError, KeyError, TypeError):  # damaged: the resume will say which file
        saved = None
    if saved is not None:
        return f"at step {step}", f"the same command resumes from step {saved}"
    if step == 1:
        return "before step 1 finished", "the same command starts again"
    return (
        f"at step {step}",
        "no checkpoint was saved (trainer.save_every=0), so rerun with a new trainer.output_dir",
    )


def describe_interruption(output_dir: str | Path) -> str:
    """``interrupted at step N; the same command resumes from step M`` (or why it cannot)."""
    where, then = describe_position(output_dir)
    return f"rlframe: interrupted {where}; {then}"
