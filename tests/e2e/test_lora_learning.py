"""The LoRA recipe learns at an fp32 rollout-vs-trainer gap below 1e-4
(``recipes/grpo_tiny_lora.yaml``): with adapter sync in the default tier, with merged sync in
the ``matrix`` tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import mean_reward_gain, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


@pytest.mark.parametrize("sync", ["adapter", pytest.param("merged", marks=pytest.mark.matrix)])
def test_lora_recipe_learns(tmp_path: Path, sync: str) -> None:
    """The default tier's learning proof of LoRA (adapter sync): the whole recipe, since
    learning through adapters alone is the claim."""
    metrics = run_recipe(
        tmp_path / "run", f"model.lora.sync={sync}", recipe="grpo_tiny_lora"
    ).metrics
    first, last = mean_reward_gain(metrics)
    gap = max(m["rollout/logprob_diff"] for m in metrics)
    print(f"LoRA {sync}: reward first 5 {first:.3f}, last 5 {last:.3f}, max lp_diff {gap:.2e}")
    assert last - first >= 0.2, (first, last)
    assert gap < 1e-4
    assert [m["rollout/weights_version"] for m in metrics] == list(range(len(metrics)))
