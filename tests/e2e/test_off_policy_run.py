"""grpo_tiny learns in lockstep with each off-policy correction, and ``rollout`` runs no
old-log-prob pass. Two mini-batches per step, so recompute and decoupled need the pass (the
default recompute run is ``test_quickstart``'s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_quickstart import run_cli

pytestmark = pytest.mark.slow

STEPS = 30


@pytest.mark.parametrize("mode", ["rollout", "decoupled"])
def test_grpo_tiny_learns_with_the_correction(tmp_path: Path, mode: str) -> None:
    metrics = run_cli(
        f"trainer.output_dir={tmp_path / 'run'}",
        f"trainer.total_steps={STEPS}",
        "actor.mini_batch_size=128",
        "actor.micro_batch_size=128",
        f"algorithm.off_policy_correction={mode}",
    )
    assert len(metrics) == STEPS
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
    rewards = [m["reward/mean"] for m in metrics]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    seconds = sum(m["timing_s/step"] for m in metrics)
    print(f"{mode}: {STEPS} steps, {seconds:.0f} s of steps, reward {first:.3f} -> {last:.3f}")
    assert last - first >= 0.04
