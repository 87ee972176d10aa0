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
KL_ESTIMATORS = ("k1", "abs", "k2", "k3")


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


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float, clip_ratio_c: float
) -> PolicyLossOutputs:
    """max(-A r, -A clip(r, 1 - low, 1 + high)), then dual-clip: at most -A c where A < 0.

    Dual-clip bounds the loss of a token whose ratio has run far above 1 + high while its
    advantage is negative, where plain PPO's max() would let it grow without limit.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    token_loss = torch.maximum(unclipped, clipped)
    metrics = {"pg_clipfrac": (clipped > unclipped).float().detach()}
    if clip_ratio_c > 1:
        dual = torch.minimum(token_loss, -advantages * clip_ratio_c)
        negative = advantages < 0
        metrics["pg_clipfrac_lower"] = ((token_loss > dual) & negative).float().detach()
        token_loss = torch.where(negative, dual, token_loss)
    return PolicyLossOutputs(token_loss, metrics)


@POLICY_LOSSES.register("ppo_clip")
def compute_ppo_clip_loss(inputs: PolicyLossInputs) -> PolicyLossOutputs:
    """PPO's clipped surrogate with separate low and high clip ranges (clip-higher) and
    dual-clip (``algorithm.clip_ratio_c``)."""
    log_ratio = (inputs.logprobs - inputs.old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    cfg = inputs.config
    out = clipped_surrogate(torch.exp(log_ratio), inputs.advantages, cfg.clip_low, cfg.clip_high, cfg.clip_ratio_c)
    out.metrics["ppo_kl"] = (-log_ratio).detach()
    return out


@POLICY_LOSSES.register("gspo")
def compute_gspo_loss(inputs: PolicyLossInputs) -> PolicyLossOutputs:
    """GSPO: one importance ratio per sequence, the geometric mean of its token ratios.

    Every token of a response carries s = exp(mean_t log r_t) as its value and its own
    log-prob's gradient (s_t = sg(s) * exp(logp_t - sg(logp_t))), so the clip decides per
    sequence. Use small clip ranges (3e-4 / 4e-4) and seq-mean-token-mean aggregation.
    """
    mask = inputs.response_mask.to(inputs.logprobs.dtype)
    log_ratio = (inputs.logprobs - inputs.old_logprobs) * mask
    seq_log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + inputs.logprobs - inputs.logprobs.detach()
    ratio = torch.exp(token_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    cfg = inputs.config
    out = clipped_surrogate(ratio, inputs.advantages, cfg.clip_low, cfg.clip_high, clip_ratio_c=0.0)
    out.metrics["ppo_kl"] = (-seq_log_ratio.detach()).unsqueeze(-1).expand_as(mask)
    return out


@POLICY_LOSSES.register("cispo")
def compute_cispo_loss(inputs: PolicyLossInputs) -> PolicyLossOutputs:
    """CISPO: REINFORCE weighted by the importance ratio, the *weight* clipped and detached.

    loss_t = -sg(min(r_t, 1 + high)) * A_t * log p_t. Unlike PPO no token's gradient is
    dropped; a token far off-policy only counts less.
    """
    log_ratio = (inputs.logprobs - inputs.old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio).detach()
    weight = ratio.clamp(max=1 + inputs.config.clip_high)
    token_loss = -weight * inputs.advantages * inputs.logprobs
    metrics = {"pg_clipfrac": (ratio > 1 + inputs.config.clip_high).float(), "ppo_kl": (-log_ratio).detach()}
    return PolicyLossOutputs(token_loss, metrics)


def apply_truncated_is(
    token_loss: torch.Tensor, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance sampling for the rollout-vs-trainer mismatch (TIS).

    The tokens were sampled by the rollout engine, whose numerics (kernels, dtype) differ
    from the trainer's: the loss is re-weighted by min(pi_old / pi_rollout, cap), computed
    from the two engines' log-probs of the same tokens and held constant.
    """
    ratio = torch.exp((old_logprobs - rollout_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)).detach()
    weight = ratio.clamp(max=cap)
    return token_loss * weight, {"tis_weight": weight, "tis_clipfrac": (ratio > cap).float()}


def compute_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1-k3).

    k1 = log p - log q (unbiased, high variance, can be negative); abs = |k1|;
    k2 = (log p - log q)^2 / 2; k3 = q/p - log(q/p) - 1 (unbiased, always >= 0). k3 is
    clamped to [-10, 10] as its exp() can explode on tokens the reference finds very unlikely.
    """
    diff = logprobs - ref_logprobs
    if estimator == "k1":
        return diff
    if estimator == "abs":
        return diff.abs()
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "k3":
        neg = (-diff).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return (torch.exp(neg) - neg - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; use one of {KL_ESTIMATORS}")


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


class KLController:
    """The coefficient of the KL penalty in the reward: fixed, or adapted toward a target.

    Adaptive (Ziegler et al.): beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * steps / horizon,
    raising beta while the policy drifts faster than the target and lowering it otherwise.
    """

    def __init__(self, coef: float, kind: str, target: float, horizon: int) -> None:
        self.value, self.kind, self.target, self.horizon = coef, kind, target, horizon

    def update(self, observed_kl: float, steps: int) -> None:
        if self.kind != "adaptive":
            return
        error = max(-0.2, min(0.2, observed_kl / self.target - 1))
        self.value *= 1 + error * steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def apply_kl_penalty(
    token_rewards: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, coef: float
) -> tuple[torch.Tensor, float]:
    """Subtract ``coef`` * k1 KL from every response token's reward; returns the batch's mean KL
    per response (summed over its tokens), which the adaptive controller tracks."""
    kl = compute_kl(old_logprobs, ref_logprobs, "k1") * mask
    mean_kl = float((kl.sum(-1)).mean())
    return token_rewards - coef * kl, mean_kl
