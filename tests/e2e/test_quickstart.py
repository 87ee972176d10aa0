"""Whole runs of the tiny recipes (in-process, on the session's Ray cluster): the README's
quickstart learns, PPO with a critic learns, two ranks with user plug-ins, and the stages only
some algorithms run."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO, RunResult, deterministic, mean_reward_gain, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

REQUIRED = [
    "reward/mean",
    "response_length/mean",
    "rollout/logprob_diff",
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/step",
    "perf/tokens_per_s",
]
ACTOR_UPDATE = [
    "actor/pg_loss",
    "actor/entropy",
    "actor/grad_norm",
    "timing_s/update",
    "timing_s/sync",
]
CRITIC = ["critic/value_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/vpred_mean"]
ACTOR_WAIT_STEPS = 2  # steps in which ppo_tiny's actor waits for the critic


def test_ppo_recipe_learns(tmp_path: Path) -> None:
    """The default tier's learning proof of PPO with a critic: the whole 150-step recipe,
    since learning is the claim (over 120 s: a critic update and a value pass a step)."""
    run = run_recipe(
        tmp_path / "run", f"critic.actor_wait_steps={ACTOR_WAIT_STEPS}", recipe="ppo_tiny"
    )
    check_tiny_recipe_learned(run, "ppo_tiny", tmp_path / "run")


def test_quickstart_learns_and_its_export_teaches_a_student(tmp_path: Path) -> None:
    """The default tier's learning proofs of lockstep GRPO (the README's quickstart, whole)
    and of on-policy distillation from it: the quickstart's policy, exported with
    ``rlframe.export``, is the teacher of a fresh ``tiny:0`` (``distill_tiny`` as is, 30
    steps: the teacher's top-8 forward KL beside the task's GRPO advantage; the teacher alone,
    ``distill.task_weight=0``, reached 0.57-0.62x here).
    The quickstart's own first 30 steps are GRPO from scratch on the same student, seed and
    prompts; its last 5 steps' reward is the teacher's (the exported policy's)."""
    run = run_recipe(tmp_path / "run", "trainer.save_every=150")
    check_tiny_recipe_learned(run, "grpo_tiny", tmp_path / "run")
    teacher = tmp_path / "teacher"
    subprocess.run(
        [sys.executable, "-m", "rlframe.export", str(tmp_path / "run"), str(teacher)],
        check=True,
        capture_output=True,
        cwd=REPO,
        timeout=300,
    )
    student = run_recipe(
        tmp_path / "student", f"distill.teacher={teacher}", recipe="distill_tiny"
    ).metrics
    check_distillation_learned(student, run.metrics)


def check_distillation_learned(student: list[dict], grpo: list[dict]) -> None:
    """Within 30 steps: at least 0.6x the teacher's reward and 3x GRPO's from scratch (both
    over steps 26-30), ``distill/reverse_kl`` halved (first 5 -> last 5), the rollout and
    the served teacher in step with the trainer and the teacher's folder (fp32)."""
    assert len(student) == 30
    reward = sum(m["reward/mean"] for m in student[25:30]) / 5
    teacher = sum(m["reward/mean"] for m in grpo[-5:]) / 5
    scratch = sum(m["reward/mean"] for m in grpo[25:30]) / 5
    kl = [m["distill/reverse_kl"] for m in student]
    first_kl, last_kl = sum(kl[:5]) / 5, sum(kl[-5:]) / 5
    worst_gap = max(m["rollout/logprob_diff"] for m in student)
    worst_teacher = max(m["distill/teacher_logprob_diff"] for m in student)
    print(
        f"distillation: student reward (steps 26-30) {reward:.3f} = "
        f"{reward / teacher:.2f}x the teacher's {teacher:.3f}, "
        f"{reward / max(scratch, 1e-9):.1f}x GRPO from scratch {scratch:.3f}; "
        f"reverse KL {first_kl:.3f} -> {last_kl:.3f}; max lp_diff {worst_gap:.2e}, "
        f"max teacher_logprob_diff {worst_teacher:.2e}"
    )
    assert reward >= 0.6 * teacher
    assert reward >= 3 * scratch
    assert last_kl <= 0.5 * first_kl
    assert worst_gap < 1e-4
    assert worst_teacher < 1e-3
    assert all(m["timing_s/teacher"] > 0 for m in student)


def check_tiny_recipe_learned(run: RunResult, recipe: str, run_dir: Path) -> None:
    """Every step logged its metrics (the critic's with PPO), the actor trained and synced
    from the step the critic's warm-up ends, the reward rose by 0.2 and the sync held."""
    ppo = recipe == "ppo_tiny"
    wait = ACTOR_WAIT_STEPS if ppo else 0
    metrics = run.metrics
    for m in metrics:
        for key in REQUIRED + (CRITIC if ppo else []):
            assert key in m, (m["step"], key)
        # The actor neither trains nor syncs while the critic warms up; from then on, every
        # step syncs once, so step k samples with weights version k - 1 - wait.
        updated = m["step"] > wait
        assert all((key in m) == updated for key in ACTOR_UPDATE), m
        assert m["rollout/weights_version"] == max(0, m["step"] - 1 - wait)
    assert (run_dir / "rollouts.jsonl").stat().st_size > 0
    first, last = mean_reward_gain(metrics)
    worst_gap = max(m["rollout/logprob_diff"] for m in metrics)
    seconds = sum(m["timing_s/step"] for m in metrics)
    print(
        f"{recipe}: {len(metrics)} steps, {seconds:.0f} s of steps, "
        f"mean reward first 5 {first:.3f} -> last 5 {last:.3f}, "
        f"max rollout/logprob_diff {worst_gap:.2e}"
    )
    assert last - first >= 0.2
    # fp32 on CPU: a healthy sync is within ~1e-6; a stale one is off by 1e-2 and more.
    assert worst_gap < 1e-4
    check_startup_and_closing_lines(run.stdout, metrics, run_dir, ppo)


def check_startup_and_closing_lines(
    console: str, metrics: list[dict], run_dir: Path, critic: bool
) -> None:
    """Once, before step 1: when it began and what the start-up was made of; at the end: the
    steps, the wall time, the reward trend (the logged one) and where the outputs are."""
    lines = console.splitlines()
    began = [line for line in lines if line.startswith("rlframe: step 1 began ")]
    assert len(began) == 1 and lines.index(began[0]) < lines.index(run_steps(lines)[0])
    phases = ("config ", "preflight ", "ray ", "workers ", "(actor boot ", "actor rollout_engine")
    for phase in phases:
        assert phase in began[0], phase
    assert ("critic boot" in began[0]) == critic
    first, last = mean_reward_gain(metrics)
    assert lines[-1].startswith(f"rlframe: done: {len(metrics)} step(s) in ")
    assert lines[-1].endswith(
        f"; reward {first:.3f} (first 5) -> {last:.3f} (last 5); outputs in {run_dir.resolve()}"
    )


def test_sequence_parallel_ranks_train_as_data_parallel_ranks(
    tmp_path: Path, two_ranks: list[dict]
) -> None:
    """The same two ranks as one sequence-parallel group (Ulysses, fp32): every logged figure
    but the wall-clock ones equals the data-parallel run's, to float tolerance."""
    run = run_recipe(tmp_path / "sp", *TWO_RANKS, "actor.sequence_parallel_size=2")
    assert "1 data x 2 sequence" in run.stdout
    sequence = run.metrics
    assert len(sequence) == len(two_ranks) == 3
    for step, (a, b) in enumerate(zip(two_ranks, sequence), start=1):
        a, b = deterministic(a), deterministic(b)
        assert a.keys() == b.keys(), step
        for key in a:
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), (step, key, a, b)
    assert two_ranks[0]["actor/grad_norm"] > 0


def run_steps(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("step ")]


TWO_RANKS = [
    "trainer.total_steps=3",
    "trainer.procs_per_node=2",
    "trainer.cpus_per_proc=1",
    "actor.micro_batch_size=64",
    "algorithm.kl_coef=0.01",
    f"algorithm.advantage={REPO / 'tests/plugins/my_algorithms.py'}:compute_sign_advantages",
    f"algorithm.policy_loss={REPO / 'tests/plugins/my_algorithms.py'}:compute_reinforce_loss",
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, ray_cluster: None) -> list[dict]:
    """Two data-parallel ranks with a KL term and the user's advantage and loss."""
    return run_recipe(tmp_path_factory.mktemp("two_ranks") / "run", *TWO_RANKS).metrics


def test_two_ranks_with_kl_and_user_plugins(two_ranks: list[dict]) -> None:
    metrics = two_ranks
    assert len(metrics) == 3
    assert all("actor/kl" in m and m["rollout/logprob_diff"] < 1e-4 for m in metrics)
    for m in metrics:
        assert 0 < m["adv/positive_frac"] < 1  # the user's estimator ran
        # The user's loss ran (its own metric, a mean log-prob), not the default ppo_clip.
        assert m["actor/logprob"] < 0 and "actor/pg_clipfrac" not in m
    assert [m["rollout/weights_version"] for m in metrics] == [0, 1, 2]


def test_remax_dapo_cispo_tis_and_kl_in_reward(tmp_path: Path) -> None:
    """The stages that only some algorithms run: greedy baseline, dynamic sampling,
    overlong shaping, truncated IS and the adaptive in-reward KL controller."""
    batch_size, n, max_rounds, coef, target, horizon = (
        16,
        16,
        4,
        0.01,
        0.1,
        10000,
    )  # grpo_tiny + below
    metrics = run_recipe(
        tmp_path / "run3",
        "trainer.total_steps=3",
        "algorithm.advantage=remax",
        "algorithm.dynamic_sampling=true",
        "algorithm.policy_loss=cispo",
        "algorithm.tis_cap=2",
        f"algorithm.kl_reward_coef={coef}",
        "algorithm.kl_reward_ctrl=adaptive",
        "algorithm.kl_coef=0.01",
        "algorithm.kl_estimator=k3+",
        "reward.overlong_buffer=1",
        "algorithm.tis_level=sequence",
        "algorithm.mismatch_mask=token",
        "algorithm.kl_reward_estimator=k2",
        f"algorithm.max_sampling_rounds={max_rounds}",
        f"algorithm.kl_target={target}",
        f"algorithm.kl_horizon={horizon}",
    ).metrics
    for m in metrics:
        for key in ("timing_s/baseline", "mismatch/tis_clipfrac", "actor/kl", "actor/reward_kl"):
            assert key in m, key
        # ReMax: the greedy responses' rewards (score + overlong penalty, in [-1, 1]) reached
        # the estimator.
        assert -1 <= m["adv/baseline_mean"] <= 1 and m["timing_s/baseline"] > 0
        # CISPO, not the default ppo_clip: no dual-clip metric. One mini-batch per step is
        # on-policy, so no IS weight is clipped.
        assert "actor/pg_clipfrac_lower" not in m and m["actor/pg_clipfrac"] == 0
        # DAPO: each group of equal rewards was dropped and another prompt admitted, at most
        # (max_sampling_rounds - 1) * batch_size of them a step.
        dropped = m["rollout/uniform_dropped"]
        assert dropped <= (max_rounds - 1) * batch_size and dropped == int(dropped)
        assert 0 < m["rollout/kept_group_frac"] <= 1
    # The adaptive controller, step by step: beta_{k+1} = beta_k (1 + clip(KL_k / target - 1,
    # -0.2, 0.2) * responses / horizon). Step 1 samples from the reference itself: KL is 0,
    # so beta must fall by 0.2 * 256 / 10000.
    assert metrics[0]["actor/reward_kl"] == 0 and metrics[0]["actor/kl_reward_coef"] == coef
    for now, after in zip(metrics, metrics[1:]):
        error = max(-0.2, min(0.2, now["actor/reward_kl"] / target - 1))
        assert after["actor/kl_reward_coef"] == pytest.approx(
            now["actor/kl_reward_coef"] * (1 + error * batch_size * n / horizon), rel=1e-9
        )
    assert metrics[1]["actor/kl_reward_coef"] == pytest.approx(
        coef * (1 - 0.2 * 256 / 10000), rel=1e-9
    )
    # A healthy weight sync leaves the engines within 1e-3 of each other: masked IS drops nothing.
    assert all(
        m["mismatch/masked_frac"] == 0 and abs(m["mismatch/ratio_mean"] - 1) < 1e-3 for m in metrics
    )
    assert all(
        m["reward/mean"] < m["reward/score_mean"] for m in metrics
    )  # overlong penalty applied
