"""What asynchronous training refused before the one producer, at ``rollout.max_staleness=1``:
DAPO's dynamic sampling, ReMax's greedy baseline and the ``openai`` agent. One short run of
all three checks each stage ran within the bound (default tier); the learning runs, as long
as the lockstep ones, are the ``matrix`` tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import mean_reward_gain, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

ASYNC = ["rollout.max_staleness=1", "algorithm.off_policy_correction=decoupled"]
REMAX_DAPO = ["algorithm.advantage=remax", "algorithm.dynamic_sampling=true"]
ROUNDS = 2


def check_within_bound(metrics: list[dict]) -> None:
    assert all(m["off_policy/staleness_max"] <= 1 for m in metrics)
    # the sync check: tokens of the trainer's own weights agree to fp32 numerics
    assert all(m.get("rollout/logprob_diff", 0.0) < 1e-4 for m in metrics)


def test_openai_agent_with_remax_and_dynamic_sampling_at_staleness_one(tmp_path: Path) -> None:
    """One short run for all three (each alone is a matrix learning run below)."""
    metrics = run_recipe(
        tmp_path / "run",
        "trainer.total_steps=3",
        "data.batch_size=4",
        "rollout.n=4",
        "actor.mini_batch_size=16",
        "actor.micro_batch_size=16",
        *ASYNC,
        *REMAX_DAPO,
        f"algorithm.max_sampling_rounds={ROUNDS}",
        recipe="openai_agent_tiny",
    ).metrics
    check_within_bound(metrics)
    for m in metrics:
        # ReMax: the greedy episodes' rewards reached the estimator.
        assert m["timing_s/baseline"] > 0 and 0 <= m["adv/baseline_mean"] <= 1
        # DAPO: groups of equal rewards were dropped and replaced, within the step's budget.
        assert m["rollout/uniform_dropped"] <= (ROUNDS - 1) * 4
        # The agent's metrics, as in lockstep.
        assert m["agent/turns/mean"] > 1 and m["agent/rows_per_episode/mean"] >= 1
        assert "agent/stuck_calls" in m and "agent/env_reward/mean" in m
    assert sum(m["rollout/uniform_dropped"] for m in metrics) > 0


@pytest.mark.matrix
def test_remax_and_dynamic_sampling_learn_at_staleness_one(tmp_path: Path) -> None:
    """The whole grpo_tiny recipe, as its asynchronous learning proof runs it."""
    metrics = run_recipe(tmp_path / "run", *ASYNC, *REMAX_DAPO).metrics
    first, last = mean_reward_gain(metrics)
    print(f"remax + dynamic sampling at staleness 1: reward {first:.3f} -> {last:.3f}")
    assert last - first >= 0.2
    check_within_bound(metrics)


@pytest.mark.matrix
def test_openai_agent_learns_at_staleness_one(tmp_path: Path) -> None:
    """40 steps, as the lockstep learning proof (tests/e2e/test_openai_agent.py)."""
    metrics = run_recipe(
        tmp_path / "run", "trainer.total_steps=40", *ASYNC, recipe="openai_agent_tiny"
    ).metrics
    first, last = mean_reward_gain(metrics)
    print(f"openai_agent_tiny at staleness 1: reward {first:.3f} -> {last:.3f}")
    assert last - first >= 0.15
    check_within_bound(metrics)
    assert max(m["off_policy/staleness_max"] for m in metrics) == 1
    assert all(m["agent/turns/mean"] > 1.5 and m["agent/obs_tokens/mean"] > 0 for m in metrics)
