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


def run_cli(*overrides: str, recipe: str = "grpo_tiny") -> list[dict]:
    out_dir = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("trainer.output_dir=")))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, "-m", "rlframe.main", f"+recipe={recipe}", *overrides],
        capture_output=True, text=True, check=False, timeout=900, env=env, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert steps, "no progress line on the console"
    assert (out_dir / "config.json").exists() and (out_dir / "rollouts.jsonl").stat().st_size > 0
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("recipe", ["grpo_tiny", "ppo_tiny"])
def test_tiny_recipe_learns(tmp_path: Path, recipe: str) -> None:
    metrics = run_cli(f"trainer.output_dir={tmp_path / 'run'}", recipe=recipe)
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    required = REQUIRED + (["critic/value_loss", "critic/grad_norm", "critic/vf_clipfrac"] if recipe == "ppo_tiny" else [])
    for key in required:
        assert all(key in m for m in metrics), key
    rewards = [m["reward/mean"] for m in metrics]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    worst_gap = max(m["rollout/logprob_diff"] for m in metrics)
    seconds = sum(m["timing_s/step"] for m in metrics)
    print(f"{recipe}: {len(metrics)} steps, {seconds:.0f} s of steps, mean reward first 5 {first:.3f} "
          f"-> last 5 {last:.3f}, max rollout/logprob_diff {worst_gap:.2e}")
    assert last - first >= 0.2
    assert worst_gap < 0.05


def test_two_ranks_with_kl_and_user_plugins(tmp_path: Path) -> None:
    plugins = REPO / "tests" / "plugins" / "my_algorithms.py"
    metrics = run_cli(
        f"trainer.output_dir={tmp_path / 'run2'}", "trainer.total_steps=3", "trainer.procs_per_node=2",
        "trainer.cpus_per_proc=1", "actor.micro_batch_size=64", "algorithm.kl_coef=0.01",
        f"algorithm.advantage={plugins}:compute_sign_advantages",
        f"algorithm.policy_loss={plugins}:compute_reinforce_loss",
    )
    assert len(metrics) == 3
    assert all("actor/kl" in m and m["rollout/logprob_diff"] < 0.05 for m in metrics)
    assert all("adv/positive_frac" in m for m in metrics)  # the user's estimator ran
    assert metrics[-1]["rollout/weights_version"] == 2


def test_remax_dapo_cispo_tis_and_kl_in_reward(tmp_path: Path) -> None:
    """The stages that only some algorithms run: greedy baseline, dynamic sampling,
    overlong shaping, truncated IS and the adaptive in-reward KL controller."""
    metrics = run_cli(
        f"trainer.output_dir={tmp_path / 'run3'}", "trainer.total_steps=3",
        "algorithm.advantage=remax", "algorithm.dynamic_sampling=true", "algorithm.policy_loss=cispo",
        "algorithm.tis_cap=2", "algorithm.kl_reward_coef=0.01", "algorithm.kl_reward_ctrl=adaptive",
        "algorithm.kl_coef=0.01", "algorithm.kl_estimator=k3+", "reward.overlong_buffer=1",
        "algorithm.tis_level=sequence", "algorithm.mismatch_mask=token", "algorithm.kl_reward_estimator=k2",
    )
    last = metrics[-1]
    for key in ("timing_s/baseline", "rollout/sampling_rounds", "rollout/kept_group_frac", "mismatch/tis_clipfrac",
                "actor/reward_kl", "actor/kl_reward_coef", "actor/kl"):
        assert key in last, key
    assert last["actor/kl_reward_coef"] != 0.01  # the adaptive controller moved it
    # A healthy weight sync leaves the engines within 1e-3 of each other: masked IS drops nothing.
    assert all(m["mismatch/masked_frac"] == 0 and abs(m["mismatch/ratio_mean"] - 1) < 1e-3 for m in metrics)
    assert all(m["reward/mean"] < m["reward/score_mean"] for m in metrics)  # overlong penalty applied
