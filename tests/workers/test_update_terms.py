"""Terms of the actor's loss as the worker's update applies them (not a copy of the loss):
mismatch (TIS) weights, the entropy bonus's sign, and the schedule on a skipped step.

Each test drives ``HybridWorker.update`` on a real one-rank FSDP2 engine in this process.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from rlframe.config import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    TrainerConfig,
)
from rlframe.core.train_batch import TrainBatch
from tests.workers.cases import make_batch as make_ragged_batch
from tests.workers.layout_cases import free_port, set_rank_env

LR = 1e-3


@pytest.fixture(scope="module", autouse=True)
def single_rank_env() -> None:
    set_rank_env(0, 1, free_port())


def make_config(warmup_steps: int = 0, **algorithm: float | str) -> Config:
    return Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=4),
        rollout=RolloutConfig(engine="hf", n=4, max_tokens=5),
        actor=ActorConfig(lr=LR, mini_batch_size=16, micro_batch_size=8, warmup_steps=warmup_steps),
        algorithm=AlgorithmConfig(**algorithm),
        trainer=TrainerConfig(total_steps=10, device="cpu", procs_per_node=1),
    )


def make_batch(advantage_scale: float = 1.0) -> TrainBatch:
    """16 ragged responses (one empty) with random advantages and old log-probs."""
    return make_ragged_batch(3, advantage_scale, ref=False)


def build_worker(model_path: str, cfg: Config):  # noqa: ANN201 (the worker class may move)
    from workers.hybrid import HybridWorker

    return HybridWorker(cfg, model_path, "cpu")


def test_truncated_is_weights_scale_the_applied_gradient(model_path: str) -> None:
    """Rollout log-probs log 2 above the old ones give every token a TIS weight of exactly 0.5
    (under the cap of 2): the update's policy gradient, and so its norm, is halved."""
    batch = make_batch()
    plain = build_worker(model_path, make_config()).update(batch).metrics
    weighted_batch = replace(batch, rollout_logprobs=batch.old_logprobs + math.log(2.0))
    weighted = build_worker(model_path, make_config(tis_cap=2.0)).update(weighted_batch).metrics
    assert plain["actor/grad_norm"] > 0
    assert weighted["actor/grad_norm"] == pytest.approx(0.5 * plain["actor/grad_norm"], rel=1e-5)
    assert weighted["actor/pg_loss"] == pytest.approx(0.5 * plain["actor/pg_loss"], rel=1e-5)
    assert weighted["actor/mismatch_weight"] == pytest.approx(0.5, rel=1e-6)


def test_masked_is_drops_the_gradient_of_tokens_outside_the_band(model_path: str) -> None:
    """A rollout/trainer ratio of 1/4 on every token lies outside [0.5, 2]: masked IS drops them
    all, so the update applies no policy gradient at all."""
    batch = make_batch()
    far = replace(batch, rollout_logprobs=batch.old_logprobs + math.log(4.0))
    metrics = build_worker(model_path, make_config(mismatch_mask="token")).update(far).metrics
    assert metrics["actor/grad_norm"] == 0.0


def test_entropy_bonus_raises_the_entropy(model_path: str) -> None:
    """With zero advantages the only gradient is the entropy bonus's: one step must raise the
    policy's entropy (a flipped sign lowers it), and the gradient scales with the coefficient."""
    batch = make_batch(advantage_scale=0.0)
    worker = build_worker(model_path, make_config(entropy_coef=0.5))
    first = worker.update(batch).metrics
    second = worker.update(batch).metrics
    assert second["actor/entropy"] > first["actor/entropy"] + 1e-4
    doubled = build_worker(model_path, make_config(entropy_coef=1.0)).update(batch).metrics
    assert first["actor/grad_norm"] > 0
    assert doubled["actor/grad_norm"] == pytest.approx(2 * first["actor/grad_norm"], rel=1e-5)
    assert doubled["actor/entropy"] == pytest.approx(first["actor/entropy"], rel=1e-6)


def test_skipped_step_leaves_the_learning_rate_schedule_alone(model_path: str) -> None:
    """Warm-up over 4 steps: lr is LR/4 before the first step and LR/2 after it. A step skipped
    for a non-finite gradient must leave the schedule where it was, as it leaves the weights."""
    worker = build_worker(model_path, make_config(warmup_steps=4))
    poisoned = make_batch()
    poisoned.advantages[0, 0] = float("nan")
    skipped = worker.update(poisoned).metrics
    assert skipped["actor/skipped_steps"] == 1
    assert skipped["actor/lr"] == pytest.approx(LR / 4)
    stepped = worker.update(make_batch()).metrics
    assert stepped["actor/skipped_steps"] == 0
    assert stepped["actor/lr"] == pytest.approx(LR / 2)
