"""What asynchronous training refused before the one producer, at ``rollout.max_staleness=1``:
DAPO's dynamic sampling with ReMax's greedy baseline (grpo_tiny), and the ``openai`` agent
(openai_agent_tiny). Short runs check each stage ran within the bound in the default tier;
the learning runs, as long as the lockstep ones, are the ``matrix`` tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import mean_reward_gain, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

ASYNC = ["rollout.max_staleness=1", "algorithm.off_policy_correction=decoupled"]
SMALL = ["data.batch_size=8", "rollout.n=8"]
SMALL += ["actor.mini_batch_size=64", "actor.micro_batch_size=64"]
REMAX_DAPO = ["algorithm.advantage=remax", "algorithm.dynamic_sampling=true"]
ROUNDS = 2


def check_within_bound(metrics: list[dict]) -> None:
    stale = [m["off_policy/staleness_max"] for m in metrics]
    assert max(stale) == 1 and all(s <= 1 for s in stale)
    # the sync check: tokens of the trainer's own weights agree to fp32 numerics
    assert all(m.get("rollout/logprob_diff", 0.0) < 1e-4 for m in metrics)


def test_remax_and_dynamic_sampling_at_staleness_one(tmp_path: Path) -> None:
    metrics = run_recipe(
        tmp_path / "run",
        "trainer.total_steps=3",
        *SMALL,
        *ASYNC,
        *REMAX_DAPO,
        f"algorithm.max_sampling_rounds={ROUNDS}",
    ).metrics
    check_within_bound(metrics)
    for m in metrics:
        # ReMax: the greedy responses' rewards reached the estimator.
        assert m["timing_s/baseline"] > 0 and 0 <= m["adv/baseline_mean"] <= 1
        # DAPO: groups of equal rewards were dropped and replaced, within the step's budget.
        assert m["rollout/uniform_dropped"] <= (ROUNDS - 1) * 8
    assert sum(m["rollout/uniform_dropped"] for m in metrics) > 0


def test_openai_agent_at_staleness_one(tmp_path: Path) -> None:
    metrics = run_recipe(
        tmp_path / "run",
        "trainer.total_steps=3",
        "data.batch_size=4",
        "rollout.n=4",
        "actor.mini_batch_size=16",
        "actor.micro_batch_size=16",
        *ASYNC,
        recipe="openai_agent_tiny",
    ).metrics
    check_within_bound(metrics)
    for m in metrics:
        assert m["agent/turns/mean"] > 1 and m["agent/rows_per_episode/mean"] >= 1
        assert "agent/stuck_calls" in m and "agent/env_reward/mean" in m


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
    assert all(m["agent/turns/mean"] > 1.5 and m["agent/obs_tokens/mean"] > 0 for m in metrics)
