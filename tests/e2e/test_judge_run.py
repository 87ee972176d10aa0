"""``+recipe=judge_tiny``: the quickstart's task scored by a generative judge alone (the
tiny judge, served on replicas of its own or on the trainer's bundles), not by a rule. The
policy learns what the judge rewards; the judge is called for every response of every step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import mean_reward_gain, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

STEPS = 40
"""Enough for the judge's reward to grow past +0.15 (see the printed trend)."""


@pytest.mark.parametrize(
    "placement", ["separate", pytest.param("colocated", marks=pytest.mark.matrix)]
)
def test_judge_tiny_learns(tmp_path: Path, placement: str) -> None:
    """The reward (the judge's expected verdict) grows by 0.15 from the first five steps to
    the last five; ``judge/calls`` is one scoring request per response (16 x 16 a step),
    nothing fails, and the policy's sync holds (``rollout/logprob_diff`` < 1e-4)."""
    run = run_recipe(
        tmp_path / "run",
        f"trainer.total_steps={STEPS}",
        f"reward.judge.placement={placement}",
        recipe="judge_tiny",
    )
    metrics = run.metrics
    first, last = mean_reward_gain(metrics)
    worst_gap = max(m["rollout/logprob_diff"] for m in metrics)
    judge_s = sum(m["judge/s"] for m in metrics) / len(metrics)
    step_s = sum(m["timing_s/step"] for m in metrics) / len(metrics)
    trend = " ".join(
        f"{sum(m['reward/mean'] for m in metrics[i : i + 5]) / 5:.3f}"
        for i in range(0, len(metrics), 5)
    )
    print(
        f"judge_tiny ({placement}): reward/mean per 5 steps {trend}; first 5 {first:.3f} -> "
        f"last 5 {last:.3f}; judge/s {judge_s:.2f} of {step_s:.2f} s a step; max "
        f"rollout/logprob_diff {worst_gap:.2e}"
    )
    for m in metrics:
        assert m["judge/calls"] == 16 * 16, m["step"]
        assert m["judge/tokens"] > 0
        assert m["judge/parse_failures"] == m["judge/timeouts"] == m["judge/errors"] == 0
        assert m["judge/score_mean"] == pytest.approx(m["reward/mean"], abs=1e-5)
    assert last - first >= 0.15
    assert worst_gap < 1e-4


@pytest.mark.matrix
def test_judge_tiny_verdicts_generated_by_the_engine_parse(tmp_path: Path) -> None:
    """The ``verdict`` scorer through a real engine: the tiny judge generates its verdict
    (greedy, up to 2 tokens: "y" or "n" and its EOS) and the ``label`` parser reads it; every
    response gets one, none fails to parse, and the scores are 0 or 1."""
    run = run_recipe(
        tmp_path / "run",
        "trainer.total_steps=3",
        "reward.judge.scorer=verdict",
        "reward.judge.parser=label",
        "reward.judge.max_tokens=2",
        recipe="judge_tiny",
    )
    for m in run.metrics:
        assert m["judge/calls"] == 16 * 16
        assert m["judge/parse_failures"] == m["judge/timeouts"] == m["judge/errors"] == 0
        # Bernoulli scores: the spread is that of a 0/1 variable of this mean.
        p = m["judge/score_mean"]
        assert m["judge/score_std"] == pytest.approx((p * (1 - p)) ** 0.5, abs=1e-6)
