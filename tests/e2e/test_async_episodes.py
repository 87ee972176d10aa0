"""Asynchronous training with multi-turn episodes (``rlframe.rollout.async_episodes``) through
the CLI: agent_tiny learns at staleness 1 on a separate rollout pool, and a run resumed from a
checkpoint holding finished, not yet trained episodes matches the straight run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_async_training import PLACEMENTS
from tests.e2e.test_long_runs import clean_env, deterministic, read_metrics
from tests.e2e.test_quickstart import REPO, run_cli

pytestmark = pytest.mark.slow

ASYNC = ["rollout.max_staleness=1", "algorithm.off_policy_correction=decoupled"]


def test_agent_tiny_learns_at_staleness_one(tmp_path: Path) -> None:
    metrics = run_cli(
        f"trainer.output_dir={tmp_path / 'run'}",
        "trainer.total_steps=60",
        *ASYNC,
        *PLACEMENTS["separate"],
        recipe="agent_tiny",
    )
    rewards = [m["reward/mean"] for m in metrics]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"agent_tiny at staleness 1: reward first 5 {first:.3f} -> last 5 {last:.3f}")
    assert last - first >= 0.2
    stale = [m["off_policy/staleness_max"] for m in metrics]
    assert max(stale) == 1 and all(s <= 1 for s in stale)
    # An episode runs on one weights version: the sync waits for the episodes in flight.
    assert all(m["off_policy/version_span_mean"] == 0 for m in metrics)
    # Turns came from the engine while the trainer trained: the driver rarely waited.
    assert all("off_policy/behav_weight_mean" in m for m in metrics)


def run(out: Path, *overrides: str) -> str:
    small = ["+recipe=agent_tiny", "data.batch_size=8", "rollout.n=8", "trainer.save_every=2"]
    small += ["actor.mini_batch_size=64", "actor.micro_batch_size=64"]
    result = subprocess.run(
        [sys.executable, "-m", "rlframe.main", *small, *ASYNC, f"trainer.output_dir={out}"]
        + [*overrides, *PLACEMENTS["separate"]],
        capture_output=True,
        text=True,
        timeout=600,
        env=clean_env(),
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    return result.stdout


def test_resume_with_episodes_in_flight_matches_straight_run(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(straight, "trainer.total_steps=4", "trainer.save_every=0")
    run(resumed, "trainer.total_steps=2")
    saved = resumed / "checkpoints" / "step_00000002" / "driver_state.json"
    in_flight = json.loads(saved.read_text())["experience"]["groups"]
    # The episodes run during step 2's update are in the checkpoint, whole, with their rows.
    assert in_flight and all(g["episode"]["tensors"]["response_ids"]["data"] for g in in_flight)
    out = run(resumed, "trainer.total_steps=4")
    assert "at step 2" in out
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        assert deterministic(x) == deterministic(y), x["step"]
    assert max(m["off_policy/staleness_max"] for m in a) == 1
