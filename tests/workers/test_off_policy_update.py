"""The off-policy corrections (``algorithm.off_policy_correction``) as the worker's update
applies them: each mode's policy loss worked out by hand from the policy's own log-probs,
``rollout`` against ``recompute``, ``decoupled`` against plain PPO, and the behaviour-weight cap.

Each test drives ``HybridWorker.update`` on a real one-rank FSDP2 engine in this process.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

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

CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0


@pytest.fixture(scope="module", autouse=True)
def single_rank_env() -> None:
    set_rank_env(0, 1, free_port())


def make_config(mode: str, **algorithm: float | str) -> Config:
    """One micro-batch of all 16 rows, so ``actor/pg_loss`` is the whole batch's token mean."""
    return Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=4),
        rollout=RolloutConfig(engine="hf", n=4, max_tokens=5),
        actor=ActorConfig(lr=1e-3, mini_batch_size=16, micro_batch_size=16),
        algorithm=AlgorithmConfig(
            off_policy_correction=mode,
            clip_low=CLIP_LOW,
            clip_high=CLIP_HIGH,
            clip_ratio_c=CLIP_C,
            **algorithm,
        ),
        trainer=TrainerConfig(total_steps=10, device="cpu", procs_per_node=1),
    )


def make_batch() -> TrainBatch:
    """16 ragged responses (one empty) with random advantages of both signs."""
    return make_ragged_batch(5, old=False, ref=False)


def build_worker(model_path: str, cfg: Config):  # noqa: ANN201 (the worker class may move)
    from workers.hybrid import HybridWorker

    return HybridWorker(cfg, model_path, "cpu")


def near(logprobs: torch.Tensor, spread: float, seed: int) -> torch.Tensor:
    """Log-probs within +-spread of ``logprobs``: ratios on both sides of the clip range."""
    g = torch.Generator().manual_seed(seed)
    return logprobs + (torch.rand(logprobs.shape, generator=g) * 2 - 1) * spread


def ppo_by_hand(
    logprobs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """[B, T] PPO clip with dual clip, times a per-token weight, written out element-wise."""
    out = torch.zeros_like(logprobs)
    for i in range(logprobs.shape[0]):
        for t in range(logprobs.shape[1]):
            r, a = math.exp(float(logprobs[i, t] - old[i, t])), float(adv[i, t])
            loss = max(-a * r, -a * min(max(r, 1 - CLIP_LOW), 1 + CLIP_HIGH))
            if a < 0:
                loss = min(loss, -a * CLIP_C)
            out[i, t] = loss * float(weight[i, t])
    return out


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values * mask).sum() / mask.sum())


@pytest.mark.parametrize("mode", ["recompute", "rollout", "decoupled"])
def test_each_mode_applies_its_loss(model_path: str, mode: str) -> None:
    """The update's pg_loss is the hand-computed loss of the mode: PPO against the batch's
    old log-probs (recompute), against the rollout's (rollout), or against the proximal
    (old) log-probs times pi_prox / pi_rollout, 0 above the cap of 2 (decoupled)."""
    batch = make_batch()
    mask, adv = batch.loss_mask, batch.advantages
    worker = build_worker(model_path, make_config(mode, behav_weight_cap=2.0))
    logprobs = worker.compute_logprobs(batch)["old_logprobs"]
    batch = replace(
        batch,
        old_logprobs=near(logprobs, 0.4, seed=1),
        rollout_logprobs=near(logprobs, 0.9, seed=2),
    )
    old, rollout = batch.old_logprobs, batch.rollout_logprobs
    ones = torch.ones_like(mask)
    if mode == "recompute":
        expected = ppo_by_hand(logprobs, old, adv, ones)
    elif mode == "rollout":
        expected = ppo_by_hand(logprobs, rollout, adv, ones)
    else:
        weight = torch.exp(old - rollout)
        weight = torch.where(weight > 2.0, 0.0, weight)
        assert 0 < float(((weight == 0) * mask).sum()) < float(mask.sum())  # the cap bites
        expected = ppo_by_hand(logprobs, old, adv, weight)
    metrics = worker.update(batch).metrics
    assert metrics["actor/grad_norm"] > 0
    assert metrics["actor/pg_loss"] == pytest.approx(token_mean(expected, mask), rel=1e-5)


def test_rollout_equals_recompute_when_the_logprobs_agree(model_path: str) -> None:
    """rollout with the trainer's log-probs as the rollout's is recompute: the same loss and
    gradient. It reads ``rollout_logprobs`` only: a wrong ``old_logprobs`` beside them (or
    none at all, with two epochs, where recompute could not take its own) changes nothing."""
    batch = make_batch()
    recompute = build_worker(model_path, make_config("recompute"))
    old = near(recompute.compute_logprobs(batch)["old_logprobs"], 0.4, seed=3)
    plain = recompute.update(replace(batch, old_logprobs=old)).metrics
    decoy = replace(batch, old_logprobs=old - 1.0, rollout_logprobs=old)
    from_rollout = build_worker(model_path, make_config("rollout")).update(decoy).metrics
    assert plain["actor/grad_norm"] > 0
    assert from_rollout["actor/grad_norm"] == pytest.approx(plain["actor/grad_norm"], rel=1e-6)
    assert from_rollout["actor/pg_loss"] == pytest.approx(plain["actor/pg_loss"], rel=1e-6)
    two_epochs = make_config("rollout")
    two_epochs.actor.epochs = 2
    only_rollout = replace(batch, rollout_logprobs=old)
    first = build_worker(model_path, two_epochs).update(only_rollout).metrics
    assert "old_logprobs" not in first  # nothing of its own to hand back
    assert first["actor/pg_loss"] != pytest.approx(plain["actor/pg_loss"], rel=1e-3)  # 2 epochs


def test_decoupled_with_behaviour_equal_to_proximal_is_plain_ppo(model_path: str) -> None:
    """Behaviour weights of exactly 1: decoupled is recompute's plain PPO, to the gradient."""
    batch = make_batch()
    recompute = build_worker(model_path, make_config("recompute"))
    old = near(recompute.compute_logprobs(batch)["old_logprobs"], 0.4, seed=4)
    plain = recompute.update(replace(batch, old_logprobs=old)).metrics
    same = replace(batch, old_logprobs=old, rollout_logprobs=old.clone())
    decoupled = build_worker(model_path, make_config("decoupled")).update(same).metrics
    assert decoupled["actor/grad_norm"] == pytest.approx(plain["actor/grad_norm"], rel=1e-6)
    assert decoupled["actor/pg_loss"] == pytest.approx(plain["actor/pg_loss"], rel=1e-6)
    assert decoupled["actor/behav_weight"] == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize(("cap", "scale"), [(4.0, 3.0), (2.0, 0.0), (0.0, 3.0)])
def test_behaviour_weight_cap_applies_at_its_setting(
    model_path: str, cap: float, scale: float
) -> None:
    """Every behaviour weight is exactly 3: under a cap of 4 (or none) the gradient triples;
    under a cap of 2 every token is dropped and no gradient is applied."""
    batch = make_batch()
    recompute = build_worker(model_path, make_config("recompute"))
    old = near(recompute.compute_logprobs(batch)["old_logprobs"], 0.4, seed=6)
    plain = recompute.update(replace(batch, old_logprobs=old)).metrics
    stale = replace(batch, old_logprobs=old, rollout_logprobs=old - math.log(3.0))
    capped = (
        build_worker(model_path, make_config("decoupled", behav_weight_cap=cap))
        .update(stale)
        .metrics
    )
    assert capped["actor/grad_norm"] == pytest.approx(scale * plain["actor/grad_norm"], rel=1e-5)
    assert capped["actor/behav_weight"] == pytest.approx(scale, rel=1e-5)
