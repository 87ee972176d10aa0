"""Run one turn's env calls concurrently, each under a timeout.

Sync methods run on their own daemon threads, ``async`` ones as tasks of one event loop,
so 64 envs that each wait 1 s finish a turn in about 1 s. Threads are daemons because a
sync call that never returns cannot be killed: after its timeout it is abandoned, and a
daemon thread does not keep the process alive at exit (a thread pool's would).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class CallOutcome:
    value: Any = None
    error: str | None = None
    """``TypeName: message`` when the call raised or timed out; None when it returned."""


def settle(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():  # timed out and cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def run_on_thread(
    loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], args: tuple[Any, ...]
) -> asyncio.Future:
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

    threading.Thread(
        target=target, daemon=True, name=f"env-{getattr(fn, '__qualname__', 'call')}"
    ).start()
    return future


EnvCall = tuple[Callable[..., Any], tuple[Any, ...]]
"""A method of an env and its arguments."""


async def run_one(
    fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float, gate: asyncio.Semaphore
) -> CallOutcome:
    async with gate:
        loop = asyncio.get_running_loop()
        work = fn(*args) if inspect.iscoroutinefunction(fn) else run_on_thread(loop, fn, args)
        try:
            return CallOutcome(value=await asyncio.wait_for(work, timeout_s))
        except TimeoutError:
            return CallOutcome(
                error=f"TimeoutError: no answer within {timeout_s:g} s (agent.step_timeout_s)"
            )
        except Exception as e:
            return CallOutcome(error=f"{type(e).__name__}: {e}")


async def run_all(calls: list[EnvCall], timeout_s: float, limit: int) -> list[CallOutcome]:
    gate = asyncio.Semaphore(limit)
    return list(await asyncio.gather(*(run_one(fn, args, timeout_s, gate) for fn, args in calls)))


def run_env_calls(calls: list[EnvCall], timeout_s: float, limit: int) -> list[CallOutcome]:
    """``fn(*args)`` for every call, at most ``limit`` at once; one outcome per call, in order.
    Never raises for a call's failure: the caller decides (error or failed episode)."""
    if not calls:
        return []
    return asyncio.run(run_all(calls, timeout_s, limit))
