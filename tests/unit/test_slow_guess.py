"""slow_guess: guess-the-number with a seeded lognormal latency per call (the latency bench's
env, ``bench/agent_latency.py``)."""

from __future__ import annotations

import inspect
import random
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rlframe.envs import ENVS, StepResult
from rlframe.envs import slow_guess as module
from rlframe.envs.runner import run_env_calls
from rlframe.envs.slow_guess import SlowGuessEnv, draw_latency


@pytest.fixture
def record() -> Iterator[list[module.EpisodeTimes]]:
    yield module.start_recording()
    module.stop_recording()


def drawn(env: SlowGuessEnv, calls: int) -> list[float]:
    return [draw_latency(env.rng, env.median_s, env.sigma) for _ in range(calls)]


def test_latencies_are_fixed_by_seed_and_episode_with_the_median_asked() -> None:
    first = drawn(SlowGuessEnv(seed=3, episode=7), 5)
    assert first == drawn(SlowGuessEnv(seed=3, episode=7), 5)
    assert first != drawn(SlowGuessEnv(seed=3, episode=8), 5)
    assert first != drawn(SlowGuessEnv(seed=4, episode=7), 5)
    many = drawn(SlowGuessEnv(median_s=0.1, sigma=1.0, episode=0), 4000)
    assert 0.09 < statistics.median(many) < 0.11
    assert max(many) > 1.0  # the long tail: sigma 1 puts 1% of calls above 1 s
    assert drawn(SlowGuessEnv(median_s=0.2, sigma=0.0, episode=0), 3) == [0.2, 0.2, 0.2]
    assert draw_latency(random.Random(0), 0.0, 1.0) == 0.0
    with pytest.raises(ValueError, match="median_s"):
        SlowGuessEnv(median_s=-1.0)


def test_episodes_are_numbered_in_the_order_they_are_made(
    record: list[module.EpisodeTimes],
) -> None:
    envs = [ENVS.get("slow_guess")() for _ in range(3)]
    assert [e.times.episode for e in envs] == [0, 1, 2]
    assert record == [e.times for e in envs]


def test_the_game_plays_through_the_runner_and_each_call_waits_its_latency(
    record: list[module.EpisodeTimes],
) -> None:
    env = SlowGuessEnv(median_s=0.02, sigma=0.5, hint_format=" {hint}:")
    # Async calls: the runner awaits them on its event loop, no thread each.
    assert inspect.iscoroutinefunction(env.reset) and inspect.iscoroutinefunction(env.step)
    expected = drawn(SlowGuessEnv(median_s=0.02, sigma=0.5, episode=0), 3)

    def call(fn: Callable[..., Any], *args: Any) -> Any:
        (outcome,) = run_env_calls([(fn, args)], timeout_s=5.0, limit=4, max_stuck=0)
        assert outcome.error is None
        return outcome.value

    sample = {"prompt": "guess 0-9:", "messages": None, "ground_truth": "6"}
    assert call(env.reset, sample) == [{"role": "user", "content": "guess 0-9:"}]
    assert call(env.step, "3") == StepResult([{"role": "user", "content": " higher:"}], 0.0, False)
    assert call(env.step, "6") == StepResult([], 1.0, True, {})
    times = record[0]  # the env that played (the next one only drew the same latencies)
    assert times is env.times and times.episode == 0
    assert times.drawn_s == expected
    assert all(w >= d for w, d in zip(times.wall_s, times.drawn_s, strict=True))
