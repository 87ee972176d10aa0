"""The adaptive in-reward KL controller inside the training loop, over several steps.

``Trainer.compute_advantages`` is the stage that applies the penalty and feeds the observed
KL back to the controller; the actor and data are not used by it, so none are built here.
"""

from __future__ import annotations

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
from rlframe.core.protocol import Batch
from rlframe.loop.trainer import Trainer

ROWS, TOKENS = 8, 3


def make_trainer(ctrl: str, horizon: int = 64, advantage: str = "grpo") -> Trainer:
    cfg = Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=2),
        rollout=RolloutConfig(engine="hf", n=4, max_tokens=TOKENS),
        actor=ActorConfig(mini_batch_size=8, micro_batch_size=4),
        algorithm=AlgorithmConfig(
            advantage=advantage,
            kl_reward_coef=0.05,
            kl_reward_ctrl=ctrl,
            kl_target=0.1,
            kl_horizon=horizon,
            kl_reward_estimator="k1",
        ),
        trainer=TrainerConfig(total_steps=1, device="cpu"),
    )
    # This stage reads neither the workers, the experience nor the weight sync.
    return Trainer(
        cfg, actor=None, critic=None, experience=None, sync_weights=lambda: 0, tracker=None
    )


def batch_with_kl(kl: float) -> Batch:
    """Every token's k1 estimate (old - ref log-prob) is ``kl``; rewards differ within groups."""
    old = torch.full((ROWS, TOKENS), -1.0)
    return Batch(
        {
            "loss_mask": torch.ones(ROWS, TOKENS),
            "reward": torch.tensor([1.0, 0.0] * (ROWS // 2)),
            "old_logprobs": old,
            "ref_logprobs": old - kl,
            "group": torch.arange(ROWS) // 4,
        }
    )


def test_adaptive_coefficient_follows_the_target_over_steps() -> None:
    trainer = make_trainer("adaptive", horizon=64)
    # KL far above the target (error clipped at +0.2), at it, below it (clipped at -0.2), a bit
    # above.
    observed = [0.5, 0.1, 0.0, 0.11]
    # Each step moves beta by clip(KL / target - 1, -0.2, 0.2) * responses / horizon = 8 / 64:
    # x1.025 (clipped +0.2), x1 (on target), x0.975 (clipped -0.2), x1.0125 (+0.1).
    expected = [0.05, 0.05125, 0.05125, 0.04996875, 0.050593359375]
    for step, kl in enumerate(observed):
        _, metrics = trainer.compute_advantages(batch_with_kl(kl))
        # The step's penalty uses the coefficient from before its own update.
        assert metrics["actor/kl_reward_coef"] == pytest.approx(
            expected[step], rel=1e-6
        )  # the KL is measured in float32
        assert metrics["actor/reward_kl"] == pytest.approx(kl, abs=1e-6)
    assert trainer.kl_ctrl.value == pytest.approx(
        expected[-1], rel=1e-6
    )  # KL is measured in float32


def test_penalty_lowers_the_rewards_by_the_current_coefficient() -> None:
    # REINFORCE++ returns (gamma 1) are the reward-to-go: reward - beta * KL summed over the
    # tokens from t on, so the first token's return is reward - beta * 3 * KL.
    trainer = make_trainer("adaptive", advantage="reinforce_pp")
    first, _ = trainer.compute_advantages(batch_with_kl(0.2))
    torch.testing.assert_close(
        first["returns"][:, 0], torch.tensor([1.0, 0.0] * 4) - 0.05 * 3 * 0.2
    )
    second, _ = trainer.compute_advantages(batch_with_kl(0.2))  # beta is now 0.05 * 1.025
    torch.testing.assert_close(
        second["returns"][:, 0], torch.tensor([1.0, 0.0] * 4) - 0.05125 * 3 * 0.2
    )


def test_fixed_coefficient_never_moves() -> None:
    trainer = make_trainer("fixed")
    for kl in (0.5, 0.0, 2.0):
        _, metrics = trainer.compute_advantages(batch_with_kl(kl))
        assert metrics["actor/kl_reward_coef"] == 0.05
    assert trainer.kl_ctrl.value == 0.05
