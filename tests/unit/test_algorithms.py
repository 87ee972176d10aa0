"""Advantages and losses against numbers computed by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlframe.algorithms.advantages import ADVANTAGES, AdvantageInputs, compute_grpo_advantages
from rlframe.algorithms.losses import (
    POLICY_LOSSES,
    LossScale,
    PolicyLossInputs,
    aggregate_loss,
    compute_kl,
    compute_ppo_clip_loss,
)
from rlframe.config import AlgorithmConfig
from rlframe.core.registry import Registry


def grpo(
    rewards: list[float],
    groups: list[int],
    norm_by_std: bool = True,
    mask: torch.Tensor | None = None,
):
    r = torch.tensor(rewards)
    m = torch.ones(len(rewards), 2) if mask is None else mask
    return compute_grpo_advantages(
        AdvantageInputs(r, m, torch.tensor(groups), AlgorithmConfig(norm_by_std=norm_by_std))
    )


def test_grpo_matches_hand_computation() -> None:
    # Group 0: rewards 1, 0, 0 -> mean 1/3, unbiased std
    # sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3).
    out = grpo([1.0, 0.0, 0.0, 0.5, 0.5, 0.5], [0, 0, 0, 1, 1, 1])
    std = math.sqrt(1 / 3)
    expected = [(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std, 0.0, 0.0, 0.0]
    torch.testing.assert_close(out.advantages[:, 0], torch.tensor(expected), atol=1e-4, rtol=0)
    torch.testing.assert_close(out.advantages[:, 1], out.advantages[:, 0])
    assert out.metrics["zero_std_frac"] == pytest.approx(0.5)


def test_all_equal_rewards_give_zero_not_nan() -> None:
    out = grpo([1.0, 1.0, 1.0, 1.0], [0, 0, 0, 0])
    assert torch.isfinite(out.advantages).all() and out.advantages.abs().max() == 0


def test_group_of_one_gives_zero() -> None:
    out = grpo([0.7, 0.2, 0.4], [0, 1, 1])
    assert out.advantages[0].abs().max() == 0
    assert torch.isfinite(out.advantages).all()


def test_dr_grpo_keeps_mean_centred_rewards_and_masks() -> None:
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    out = grpo([1.0, 0.0], [5, 5], norm_by_std=False, mask=mask)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.5, 0.0], [-0.5, -0.5]]))


def test_ppo_clip_uses_separate_low_and_high_ranges() -> None:
    cfg = AlgorithmConfig(clip_low=0.2, clip_high=0.28)
    old = torch.zeros(1, 4)
    # ratios 1.5, 1.5, 0.5, 0.5 with advantages +1, -1, +1, -1
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    out = compute_ppo_clip_loss(PolicyLossInputs(logp, old, adv, torch.ones(1, 4), cfg))
    # A>0, r=1.5: max(-1.5, -1.28) = -1.28 (clipped high). A<0, r=1.5: max(1.5, 1.28) = 1.5.
    # A>0, r=0.5: max(-0.5, -0.8) = -0.5.       A<0, r=0.5: max(0.5, 0.8) = 0.8 (clipped low).
    torch.testing.assert_close(out.token_loss, torch.tensor([[-1.28, 1.5, -0.5, 0.8]]))
    assert out.metrics["pg_clipfrac"].tolist() == [[1.0, 0.0, 0.0, 1.0]]


def test_ppo_clip_gradient_is_zero_where_clipped() -> None:
    logp = torch.log(torch.tensor([[1.5, 0.9]])).requires_grad_()
    out = compute_ppo_clip_loss(
        PolicyLossInputs(
            logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), AlgorithmConfig()
        )
    )
    out.token_loss.sum().backward()
    # d(-A r)/d logp = -A r: zero on the clipped token, -0.9 on the other.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.9]]))


def test_kl_estimators() -> None:
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    d = math.log(2.0)
    torch.testing.assert_close(compute_kl(logp, ref, "k1"), torch.tensor([d]))
    torch.testing.assert_close(compute_kl(logp, ref, "k2"), torch.tensor([0.5 * d * d]))
    torch.testing.assert_close(compute_kl(logp, ref, "k3"), torch.tensor([0.5 - math.log(0.5) - 1]))
    assert compute_kl(logp, logp, "k3").item() == 0.0
    with pytest.raises(ValueError, match="k4"):
        compute_kl(logp, ref, "k4")


@pytest.mark.parametrize("chunk", [0, 2])
def test_entropy_of_uniform_is_log_vocab(chunk: int) -> None:
    # Zero hidden states give zero logits: the uniform distribution over the 8 tokens.
    from workers.training.token_logprobs import compute_token_logprobs

    out = compute_token_logprobs(
        torch.zeros(6, 4), torch.randn(8, 4), torch.zeros(6, dtype=torch.long), 1.0, chunk, True
    )
    torch.testing.assert_close(out.entropy, torch.full((6,), math.log(8)))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregation_is_invariant_to_micro_batch_split(mode: str) -> None:
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[3] = 0  # a zero-length response
    scale = LossScale(tokens=float(mask.sum()), sequences=6.0)
    whole = aggregate_loss(loss, mask, mode, scale)
    parts = sum(
        aggregate_loss(loss[i : i + 2], mask[i : i + 2], mode, scale) for i in range(0, 6, 2)
    )
    torch.testing.assert_close(whole, parts)
    assert torch.isfinite(whole)


def test_aggregation_hand_numbers() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    scale = LossScale(tokens=4, sequences=2)
    assert aggregate_loss(loss, mask, "token-mean", scale).item() == pytest.approx(10 / 4)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean", scale).item() == pytest.approx(
        (2 + 4) / 2
    )
    assert aggregate_loss(loss, mask, "seq-mean-token-sum", scale).item() == pytest.approx(
        (6 + 4) / 2
    )


def test_registry_refuses_duplicates_and_loads_user_files(tmp_path: Path) -> None:
    reg: Registry = Registry("thing")
    reg.register("a")(len)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(len)
    with pytest.raises(KeyError, match="registered: \\['a'\\]"):
        reg.get("b")
    plugin = tmp_path / "my_adv.py"
    plugin.write_text("def double(x):\n    return 2 * x\n")
    assert reg.get(f"{plugin}:double")(4) == 8
    assert reg.get("math:sqrt")(9.0) == 3.0
    assert "grpo" in ADVANTAGES and "ppo_clip" in POLICY_LOSSES
