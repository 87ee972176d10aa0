"""grpo_tiny in lockstep with each off-policy correction: ``rollout`` runs no old-log-prob pass
and leaves no trainer log-probs to compare; ``decoupled`` runs the pass and, in lockstep, weighs
every token by 1. Two mini-batches per step, so recompute and decoupled need the pass (the
default recompute run is ``test_quickstart``'s). Three steps prove the plumbing in the default
tier; thirty steps that learn are the ``matrix`` tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import mean_reward_gain, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


@pytest.mark.parametrize(
    "mode,steps",
    [
        ("rollout", 3),
        ("decoupled", 3),
        pytest.param("rollout", 30, marks=pytest.mark.matrix),
        pytest.param("decoupled", 30, marks=pytest.mark.matrix),
    ],
)
def test_grpo_tiny_with_the_correction(tmp_path: Path, mode: str, steps: int) -> None:
    metrics = run_recipe(
        tmp_path / "run",
        f"trainer.total_steps={steps}",
        "actor.mini_batch_size=128",
        "actor.micro_batch_size=128",
        f"algorithm.off_policy_correction={mode}",
    ).metrics
    assert len(metrics) == steps
    for m in metrics:
        # rollout: the engine's log-probs are the old policy, so the pass never runs.
        assert ("timing_s/old_logprob" in m) == (mode == "decoupled"), m
        # rollout has no trainer log-probs to compare the engine's with.
        assert ("rollout/logprob_diff" in m) == (mode == "decoupled"), m
        if mode == "decoupled":
            # Lockstep: behaviour and proximal policy are the same weights in two engines.
            assert abs(m["off_policy/behav_weight_mean"] - 1) < 1e-3
            assert m["off_policy/behav_capped_frac"] == 0.0
        else:
            assert "off_policy/behav_weight_mean" not in m
    if steps < 30:
        return
    first, last = mean_reward_gain(metrics)
    seconds = sum(m["timing_s/step"] for m in metrics)
    print(f"{mode}: {steps} steps, {seconds:.0f} s of steps, reward {first:.3f} -> {last:.3f}")
    assert last - first >= 0.04
