"""Whole runs of the CLI on the tiny model: the README's quickstart, and two ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
REQUIRED = [
    "reward/mean", "response_length/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm",
    "rollout/logprob_diff", "timing_s/gen", "timing_s/reward", "timing_s/update", "timing_s/sync",
    "timing_s/step", "perf/tokens_per_s",
]


def run_cli(*overrides: str) -> list[dict]:
    out_dir = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("trainer.output_dir=")))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, "-m", "rlframe.main", "+recipe=grpo_tiny", *overrides],
        capture_output=True, text=True, timeout=900, env=env, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert steps, "no progress line on the console"
    assert (out_dir / "config.json").exists() and (out_dir / "rollouts.jsonl").stat().st_size > 0
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_quickstart_learns(tmp_path: Path) -> None:
    metrics = run_cli(f"trainer.output_dir={tmp_path / 'run'}")
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    for key in REQUIRED:
        assert all(key in m for m in metrics), key
    rewards = [m["reward/mean"] for m in metrics]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    worst_gap = max(m["rollout/logprob_diff"] for m in metrics)
    seconds = sum(m["timing_s/step"] for m in metrics)
    print(f"grpo_tiny: {len(metrics)} steps, {seconds:.0f} s of steps, mean reward first 5 {first:.3f} "
          f"-> last 5 {last:.3f}, max rollout/logprob_diff {worst_gap:.2e}")
    assert last - first >= 0.2
    assert worst_gap < 0.05


def test_two_ranks_with_kl(tmp_path: Path) -> None:
    metrics = run_cli(
        f"trainer.output_dir={tmp_path / 'run2'}", "trainer.total_steps=3", "trainer.procs_per_node=2",
        "trainer.cpus_per_proc=1", "actor.micro_batch_size=64", "algorithm.kl_coef=0.01",
    )
    assert len(metrics) == 3
    assert all("actor/kl" in m and m["rollout/logprob_diff"] < 0.05 for m in metrics)
    assert metrics[-1]["rollout/weights_version"] == 2
