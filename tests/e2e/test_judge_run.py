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
