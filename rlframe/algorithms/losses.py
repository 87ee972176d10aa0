"""Policy losses, KL estimators and loss aggregation: pure tensor code.

A policy loss takes :class:`PolicyLossInputs` and returns per-token losses plus metrics;
:func:`aggregate_loss` then reduces them. Aggregation divides by counts of the whole
mini-batch (all micro-batches, all ranks), not of the micro-batch at hand, so that
splitting a mini-batch into micro-batches or over ranks never changes the gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlframe.algorithms.registry import Registry
from rlframe.config import AlgorithmConfig

# exp() of a log-ratio beyond this overflows nothing but makes gradients useless.
MAX_LOG_RATIO = 20.0


@dataclass
class PolicyLossInputs:
    logprobs: torch.Tensor
    """[B, T] log-probs of the response tokens under the policy being trained."""
    old_logprobs: torch.Tensor
    """[B, T] log-probs under the policy that sampled them (no gradient)."""
    advantages: torch.Tensor
    """[B, T] per-token advantages."""
    response_mask: torch.Tensor
    """[B, T] 1 on response tokens that count."""
    config: AlgorithmConfig


@dataclass
class PolicyLossOutputs:
    token_loss: torch.Tensor
    """[B, T] per-token loss (aggregated later by ``aggregate_loss``)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-token metric tensors ([B, T]); averaged over the mask by the caller."""


PolicyLossFn = Callable[[PolicyLossInputs], PolicyLossOutputs]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


@POLICY_LOSSES.register("ppo_clip")
def compute_ppo_clip_loss(inputs: PolicyLossInputs) -> PolicyLossOutputs:
    """PPO's clipped surrogate with separate low and high clip ranges (clip-higher)."""
    cfg = inputs.config
    log_ratio = (inputs.logprobs - inputs.old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -inputs.advantages * ratio
    clipped = -inputs.advantages * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    token_loss = torch.maximum(unclipped, clipped)
    metrics = {
        "pg_clipfrac": (clipped > unclipped).float().detach(),
        "ppo_kl": (-log_ratio).detach(),
    }
    return PolicyLossOutputs(token_loss, metrics)


def compute_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1-k3).

    k1 = log p - log q (unbiased, high variance, can be negative); k2 = (log p - log q)^2 / 2;
    k3 = q/p - log(q/p) - 1 (unbiased, always >= 0). k3 is clamped to [-10, 10] as its
    exp() can explode on tokens the reference finds very unlikely.
    """
    diff = logprobs - ref_logprobs
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "k3":
        neg = (-diff).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return (torch.exp(neg) - neg - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; use k1, k2 or k3")


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution at each position ([..., V] -> [...])."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


@dataclass
class LossScale:
    """Counts over the whole mini-batch that every micro-batch's loss is divided by."""

    tokens: float
    """Response tokens in the mini-batch, over all ranks."""
    sequences: float
    """Responses in the mini-batch, over all ranks."""


AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def aggregate_loss(token_loss: torch.Tensor, mask: torch.Tensor, mode: str, scale: LossScale) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss.

    - ``token-mean``: sum over all tokens / mini-batch tokens (every token weighs the same).
    - ``seq-mean-token-mean``: each response's token mean, summed / mini-batch responses.
    - ``seq-mean-token-sum``: each response's token sum, summed / mini-batch responses.

    Summing these shares over the micro-batches and ranks of a mini-batch gives exactly the
    loss of the mini-batch computed in one piece.
    """
    mask = mask.to(token_loss.dtype)
    if mode == "token-mean":
        return (token_loss * mask).sum() / max(scale.tokens, 1.0)
    per_seq_sum = (token_loss * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        return (per_seq_sum / mask.sum(-1).clamp(min=1)).sum() / max(scale.sequences, 1.0)
    if mode == "seq-mean-token-sum":
        return per_seq_sum.sum() / max(scale.sequences, 1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {AGGREGATIONS}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)
