"""Asynchronous training with multi-turn episodes (whole episodes, ``rlframe.rollout.producer``):
agent_tiny learns at staleness 1 on a separate rollout pool (``matrix`` tier: the default tier
proves async learning with grpo_tiny and multi-turn learning in lockstep), and a run resumed
from a checkpoint holding finished, not yet trained episodes matches the straight run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlframe.rollout.state_json import decode_state
from tests.checkpoints import resume_from_copy
from tests.e2e.async_cases import PLACEMENTS
from tests.harness import deterministic, mean_reward_gain, read_metrics, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

ASYNC = ["rollout.max_staleness=1", "algorithm.off_policy_correction=decoupled"]


@pytest.mark.matrix
def test_agent_tiny_learns_at_staleness_one(tmp_path: Path) -> None:
    metrics = run_recipe(
        tmp_path / "run",
        "trainer.total_steps=60",
        *ASYNC,
        *PLACEMENTS["separate"],
        recipe="agent_tiny",
    ).metrics
    first, last = mean_reward_gain(metrics)
    print(f"agent_tiny at staleness 1: reward first 5 {first:.3f} -> last 5 {last:.3f}")
    assert last - first >= 0.2
    stale = [m["off_policy/staleness_max"] for m in metrics]
    assert max(stale) == 1 and all(s <= 1 for s in stale)
    # An episode runs on one weights version: the sync waits for the episodes in flight.
    assert all(m["off_policy/version_span_mean"] == 0 for m in metrics)
    # Turns came from the engine while the trainer trained: the driver rarely waited.
    assert all("off_policy/behav_weight_mean" in m for m in metrics)


SMALL = ["data.batch_size=8", "rollout.n=8", "trainer.save_every=2", "trainer.total_steps=4"]
SMALL += ["actor.mini_batch_size=64", "actor.micro_batch_size=64", *ASYNC]


def test_resume_with_episodes_in_flight_matches_straight_run(tmp_path: Path) -> None:
    """Two runs: four steps saved at 2 and 4; a copy resumed from the step-2 checkpoint."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_recipe(straight, *SMALL, *PLACEMENTS["separate"], recipe="agent_tiny")
    saved = resume_from_copy(straight, resumed, 2)
    experience = json.loads((saved / "driver_state.json").read_text())["experience"]
    in_flight = decode_state(experience)["groups"]
    # The episodes run during step 2's update are in the checkpoint, whole and scored.
    assert in_flight and all(len(g["scored"]["tensors"]["reward"]) for g in in_flight)
    out = run_recipe(resumed, *SMALL, *PLACEMENTS["separate"], recipe="agent_tiny").stdout
    assert "at step 2" in out
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        assert deterministic(x) == deterministic(y), x["step"]
    assert max(m["off_policy/staleness_max"] for m in a) == 1
