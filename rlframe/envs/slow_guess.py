"""Guess the number with a tool-like latency on every call (``agent.env=slow_guess``).

The game is :class:`rlframe.envs.guess.GuessNumberEnv`'s; each ``reset`` and ``step`` first
waits a latency drawn from a lognormal distribution (median ``median_s``, log-space standard
deviation ``sigma``), as a tool call or a sandbox would. The calls are ``async`` and wait with
``asyncio.sleep``: they hold no thread and no core, as an env waiting on I/O would (a sync env
would block a thread of :mod:`rlframe.envs.runner` instead). ``median_s=0`` plays the same
game without waiting, through the same code path.

Episodes are numbered in the order their envs are made in this process (one env per episode),
and episode ``k`` draws its latencies from its own generator seeded with ``(seed, k)``, so a
run that makes its episodes in the same order waits the same times. ``bench/agent_latency.py``
reads each episode's own env time from :data:`RECORD`.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from rlframe.envs.base import ENVS, Message, StepResult
from rlframe.envs.guess import GuessNumberEnv


@dataclass
class EpisodeTimes:
    """One episode's env calls: what each was drawn to wait and how long it took."""

    episode: int
    drawn_s: list[float] = field(default_factory=list)
    """The drawn latency of each call, in order: reset, then each step."""
    wall_s: list[float] = field(default_factory=list)
    """The wall-clock time of each call, latency included."""


RECORD: list[EpisodeTimes] | None = None
"""Every episode's :class:`EpisodeTimes`, in the order the episodes were made, when set to a
list (see :func:`start_recording`); None keeps nothing."""
EPISODES = itertools.count()
"""The number of the next episode made in this process."""


def start_recording() -> list[EpisodeTimes]:
    """Number episodes from 0 again and keep every episode's times in the returned list."""
    global RECORD, EPISODES
    RECORD, EPISODES = [], itertools.count()
    return RECORD


def stop_recording() -> None:
    global RECORD
    RECORD = None


def draw_latency(rng: random.Random, median_s: float, sigma: float) -> float:
    """A lognormal latency with median ``median_s`` (0: none)."""
    return rng.lognormvariate(math.log(median_s), sigma) if median_s > 0 else 0.0


@ENVS.register("slow_guess")
class SlowGuessEnv:
    """The game of a :class:`GuessNumberEnv`, each call late by a drawn latency.

    Args (besides the game's ``hint_format`` and ``correct_reward``):
    median_s: median latency of a call, seconds (0: none).
    sigma: standard deviation of the latency's logarithm (lognormal); 0 waits exactly
        ``median_s``.
    seed: the latencies' seed; episode ``k`` of a process draws from ``(seed, k)``.
    episode: this env's episode number (default: the next one of the process).
    """

    def __init__(
        self,
        median_s: float = 0.1,
        sigma: float = 1.0,
        seed: int = 0,
        episode: int | None = None,
        hint_format: str = "Wrong: the number is {hint}. Guess again.",
        correct_reward: float = 1.0,
    ) -> None:
        self.game = GuessNumberEnv(hint_format, correct_reward)
        if median_s < 0 or sigma < 0:
            raise ValueError(f"slow_guess: median_s={median_s} and sigma={sigma} must be >= 0")
        self.median_s, self.sigma = float(median_s), float(sigma)
        self.times = EpisodeTimes(next(EPISODES) if episode is None else int(episode))
        self.rng = random.Random(f"slow_guess/{int(seed)}/{self.times.episode}")
        if RECORD is not None:
            RECORD.append(self.times)

    async def wait(self) -> float:
        """Wait one call's latency; returns the drawn latency."""
        latency = draw_latency(self.rng, self.median_s, self.sigma)
        if latency > 0:
            await asyncio.sleep(latency)
        return latency

    async def reset(self, sample: dict[str, Any]) -> list[Message]:
        start = time.perf_counter()
        self.times.drawn_s.append(await self.wait())
        messages = self.game.reset(sample)
        self.times.wall_s.append(time.perf_counter() - start)
        return messages

    async def step(self, action: str) -> StepResult:
        start = time.perf_counter()
        self.times.drawn_s.append(await self.wait())
        result = self.game.step(action)
        self.times.wall_s.append(time.perf_counter() - start)
        return result
