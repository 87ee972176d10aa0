"""The LoRA recipe learns with each weight-sync mode, at an fp32 rollout-vs-trainer gap below
1e-4 (``recipes/grpo_tiny_lora.yaml``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_long_runs import read_metrics
from tests.e2e.test_lora_run import run_cli

pytestmark = pytest.mark.slow


def check_learns(out: Path, *overrides: str) -> None:
    run_cli(out, "+recipe=grpo_tiny_lora", *overrides)
    metrics = read_metrics(out)
    rewards = [m["reward/mean"] for m in metrics]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    gap = max(m["rollout/logprob_diff"] for m in metrics)
    print(f"LoRA {overrides}: reward first 5 {first:.3f}, last 5 {last:.3f}, max lp_diff {gap:.2e}")
    assert last - first >= 0.2, (first, last)
    assert gap < 1e-4
    assert [m["rollout/weights_version"] for m in metrics] == list(range(len(metrics)))


def test_lora_recipe_learns_with_merged_sync(tmp_path: Path) -> None:
    check_learns(tmp_path / "run", "model.lora.sync=merged")


def test_lora_recipe_learns_with_adapter_sync(tmp_path: Path) -> None:
    check_learns(tmp_path / "run", "model.lora.sync=adapter")
