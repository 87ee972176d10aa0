"""Run one turn's env calls concurrently, each under a timeout.

Sync methods run on their own daemon threads, ``async`` ones as tasks of one event loop,
so 64 envs that each wait 1 s finish a turn in about 1 s. An ``async`` call past its timeout
is cancelled. A sync one cannot be stopped: it is abandoned on its daemon thread (which does
not keep the process alive at exit, as a thread pool's would) and counted while it runs on
(``agent/stuck_calls``); more than ``agent.max_stuck_calls`` of them stop the run, where
they used to pile up by hundreds a step.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlframe.envs.base import EnvError

STUCK: set[threading.Thread] = set()
"""Threads of sync calls abandoned at their timeout (this process, every run)."""
STUCK_LOCK = threading.Lock()


def count_stuck_calls() -> int:
    """Sync calls abandoned at their timeout that are still running."""
    with STUCK_LOCK:
        STUCK.difference_update([t for t in STUCK if not t.is_alive()])
        return len(STUCK)


@dataclass
class CallOutcome:
    value: Any = None
    error: str | None = None
    """``TypeName: message`` when the call raised or timed out; None when it returned."""


def settle(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():  # timed out and cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def run_on_thread(
    loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[asyncio.Future[Any], threading.Thread]:
    future = loop.create_future()

    def target() -> None:
        value, error = None, None
        try:
            value = fn(*args)
        except BaseException as e:  # handed to the waiting coroutine, which reports it
            error = e
        try:
            loop.call_soon_threadsafe(settle, future, value, error)
        except RuntimeError:  # the loop closed after a timeout: nobody waits any more
            pass

    thread = threading.Thread(
        target=target, daemon=True, name=f"env-{getattr(fn, '__qualname__', 'call')}"
    )
    thread.start()
    return future, thread


EnvCall = tuple[Callable[..., Any], tuple[Any, ...]]
"""A method of an env and its arguments."""


async def run_one(
    fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float, gate: asyncio.Semaphore
) -> CallOutcome:
    async with gate:
        loop = asyncio.get_running_loop()
        thread = None
        if inspect.iscoroutinefunction(fn):
            work = fn(*args)
        else:
            work, thread = run_on_thread(loop, fn, args)
        try:
            return CallOutcome(value=await asyncio.wait_for(work, timeout_s))
        except TimeoutError:
            if thread is not None and thread.is_alive():
                with STUCK_LOCK:
                    STUCK.add(thread)
            return CallOutcome(
                error=f"TimeoutError: no answer within {timeout_s:g} s (agent.step_timeout_s)"
            )
        except Exception as e:
            return CallOutcome(error=f"{type(e).__name__}: {e}")


async def run_all(calls: list[EnvCall], timeout_s: float, limit: int) -> list[CallOutcome]:
    gate = asyncio.Semaphore(limit)
    return list(await asyncio.gather(*(run_one(fn, args, timeout_s, gate) for fn, args in calls)))


def run_env_calls(
    calls: list[EnvCall], timeout_s: float, limit: int, max_stuck: int
) -> list[CallOutcome]:
    """``fn(*args)`` for every call, at most ``limit`` at once; one outcome per call, in order.
    Never raises for a call's failure: the caller decides (error or failed episode). Raises
    EnvError when more than ``max_stuck`` abandoned sync calls are still running after."""
    if not calls:
        return []
    outcomes = asyncio.run(run_all(calls, timeout_s, limit))
    check_stuck_calls(max_stuck, timeout_s, getattr(calls[0][0], "__qualname__", "the env"))
    return outcomes


def check_stuck_calls(max_stuck: int, timeout_s: float, name: str) -> None:
    """Raise EnvError when more than ``max_stuck`` abandoned sync calls (such as ``name``)
    are still running."""
    stuck = count_stuck_calls()
    if stuck > max_stuck:
        raise EnvError(
            f"{stuck} sync calls (such as {name}) that ran past agent.step_timeout_s="
            f"{timeout_s:g} are still running, more than agent.max_stuck_calls={max_stuck}: "
            "a thread cannot be stopped, so each one that hangs is kept for good; make the "
            "env or agent return (or make it async: a timed-out coroutine is cancelled)"
        )
