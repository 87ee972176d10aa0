"""Distillation's cross product (the ``matrix`` tier): a teacher on a pool of its own and one
beside the policy give the same run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.harness import deterministic, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.matrix, pytest.mark.usefixtures("ray_cluster")]

# A teacher pool of its own needs a third CPU beside the trainer's two (the session's Ray has 4).
SHORT = ["trainer.total_steps=3", "ray.num_cpus=3"]


def test_separate_and_colocated_teachers_give_the_same_steps(tmp_path: Path) -> None:
    """fp32 on CPU: every logged figure but the wall-clock ones equal to 1e-5 relative (the
    teacher's engine is the same model on both; only its processes differ)."""
    runs = {
        placement: run_recipe(
            tmp_path / placement, *SHORT, f"distill.placement={placement}", recipe="distill_tiny"
        ).metrics
        for placement in ("separate", "colocated")
    }
    for step, (a, b) in enumerate(zip(runs["separate"], runs["colocated"]), start=1):
        a, b = deterministic(a), deterministic(b)
        assert a.keys() == b.keys(), step
        assert "distill/reverse_kl" in a and "distill/teacher_logprob_diff" in a
        for key in a:
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), (step, key, a, b)
