"""Separate rollout placement trains exactly like colocated: same seeds, same samples, same
updates. One trainer rank + one rollout rank (1 CPU each) against one hybrid rank (1 CPU)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.harness import run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

STEPS = 3
# Same samples: rewards, lengths, clip ratio. Same updates: losses, entropy, gradient norm.
COMPARED = [
    "reward/mean",
    "reward/max",
    "reward/min",
    "response_length/mean",
    "response_length/max",
    "response_length/clip_ratio",
    "actor/pg_loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "adv/zero_std_frac",
    "rollout/logprob_diff",
    "rollout/weights_version",
]


def test_separate_placement_gives_the_colocated_metrics(tmp_path: Path) -> None:
    common = [f"trainer.total_steps={STEPS}", "trainer.cpus_per_proc=1", "ray.num_cpus=2"]
    colocated = run_recipe(tmp_path / "colocated", *common).metrics
    separate = run_recipe(
        tmp_path / "separate", *common, "rollout.placement=separate", "rollout.cpus_per_proc=1"
    ).metrics
    assert len(colocated) == len(separate) == STEPS
    for step, (c, s) in enumerate(zip(colocated, separate), start=1):
        for key in COMPARED:
            assert math.isclose(c[key], s[key], rel_tol=1e-5, abs_tol=1e-7), (step, key, c, s)
        # The rollout pool sampled with the weights the trainer just sent.
        assert s["rollout/logprob_diff"] < 1e-4
        assert s["rollout/weights_version"] == step - 1
    # The updates moved the policy: equal metrics are not equal because nothing happened.
    assert colocated[0]["actor/grad_norm"] > 0
    assert colocated[0]["reward/mean"] != colocated[-1]["reward/mean"]
