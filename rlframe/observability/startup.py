"""How long a run took to reach its first step, and what that time was made of.

The driver marks each start-up phase as it ends (:data:`DRIVER`); each worker keeps a clock of
its own from its process start, which the launcher reads from rank 0 of every group. When step
1 begins, the run prints one console line and writes the detail to ``driver.log``:

    rlframe: step 1 began 11.6 s after the command: interpreter 0.9, config 0.5, ...

Phases are consecutive: each is the time since the previous mark, so they add up to the total.
A phase marked twice adds both spans (``preflight``: the checks before Ray, then those made
while Ray starts). What ran beside the driver's own line is shown in brackets inside the phase
it overlapped and not added: ``ray (ray start S)`` is Ray's whole start on its thread, ``workers
(..., driver checks S, placement S)`` the tokenizer and prompt checks made while the workers
constructed, and the creation of the pools' placement groups (before the workers started: it
is part of the phase's own time, not beside it).
"""

from __future__ import annotations

import json
import logging
import os
import time

logger = logging.getLogger(__name__)


def process_start_time() -> float:
    """The wall-clock time this process started (Linux ``/proc``; else the first call)."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22, after the command name in parentheses: start time in clock ticks
            # since boot.
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class StartupClock:
    """Consecutive named phases from an origin (wall-clock seconds).

    Args:
        origin: when the clock starts; the process start when None.
    """

    def __init__(self, origin: float | None = None) -> None:
        self.origin = process_start_time() if origin is None else origin
        self.last = self.origin
        self.phases: dict[str, float] = {}
        self.parts: dict[str, dict[str, float]] = {}
        """Phases measured elsewhere (a worker's), by the phase of ours they fall in."""

    def mark(self, phase: str) -> float:
        """End ``phase`` now: record the time since the previous mark; return it."""
        now = time.time()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now
        return self.phases[phase]

    def attach(self, phase: str, parts: dict[str, float], prefix: str = "") -> None:
        """Record what ``phase`` was made of, as measured by someone else (a worker's clock;
        ``prefix`` names it when several report)."""
        inner = self.parts.setdefault(phase, {})
        for name, seconds in parts.items():
            inner[f"{prefix}{name}"] = seconds

    @property
    def total(self) -> float:
        """Seconds from the origin to the last mark."""
        return self.last - self.origin

    def total_since_origin(self) -> float:
        """Seconds from the origin to now."""
        return time.time() - self.origin

    def describe(self) -> str:
        """``interpreter 0.9, config 0.5, ..., workers 6.1 (vllm_import 3.9, ...), ...``."""
        items = []
        for phase, seconds in self.phases.items():
            text = f"{phase} {seconds:.1f}"
            if self.parts.get(phase):
                inner = ", ".join(f"{k} {v:.1f}" for k, v in self.parts[phase].items())
                text += f" ({inner})"
            items.append(text)
        return ", ".join(items)


DRIVER = StartupClock()
"""The driver's clock. :func:`begin_driver_clock` restarts it for each run of the process."""
RUNS_BEGUN: list[float] = []


def begin_driver_clock() -> None:
    """Start the driver's clock: from the process start for the process's first run (the
    interpreter's start-up is then its first phase), else from now (a notebook, the tests)."""
    global DRIVER
    DRIVER = StartupClock(None if not RUNS_BEGUN else time.time())
    RUNS_BEGUN.append(DRIVER.origin)
    DRIVER.mark("interpreter")


def report_first_step(step: int) -> None:
    """Mark the end of start-up; print the console line and write the detail to the log."""
    DRIVER.mark("loop_setup")
    print(
        f"rlframe: step {step} began {DRIVER.total:.1f} s after the command: {DRIVER.describe()}",
        flush=True,
    )
    detail = {"total_s": DRIVER.total, "phases_s": DRIVER.phases, "parts_s": DRIVER.parts}
    logger.info("start-up: %s", json.dumps(detail))
