"""Policy losses, KL estimators and loss aggregation: pure tensor code.

A policy loss takes :class:`PolicyLossInputs` and returns per-token losses plus metrics;
:func:`aggregate_loss` then reduces them. Aggregation divides by counts of the whole
mini-batch (all micro-batches, all ranks), not of the micro-batch at hand, so that
splitting a mini-batch into micro-batches or over ranks never changes the gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rlframe.core.names import KL_ESTIMATORS, LOSS_AGGREGATIONS
from rlframe.core.registry import Registry

if TYPE_CHECKING:
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
    loss_mask: torch.Tensor
    """[B, T] 1 on response tokens the policy sampled (padding and tool observations 0)."""
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
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float,
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
    out = clipped_surrogate(
        torch.exp(log_ratio), inputs.advantages, cfg.clip_low, cfg.clip_high, cfg.clip_ratio_c
    )
    out.metrics["ppo_kl"] = (-log_ratio).detach()
    return out


@POLICY_LOSSES.register("gspo")
def compute_gspo_loss(inputs: PolicyLossInputs) -> PolicyLossOutputs:
    """GSPO: one importance ratio per sequence, the geometric mean of its token ratios.

    Every token of a response carries s = exp(mean_t log r_t) as its value and its own
    log-prob's gradient (s_t = sg(s) * exp(logp_t - sg(logp_t))), so the clip decides per
    sequence. Use small clip ranges (3e-4 / 4e-4) and seq-mean-token-mean aggregation.
    """
    mask = inputs.loss_mask.to(inputs.logprobs.dtype)
    log_ratio = (inputs.logprobs - inputs.old_logprobs) * mask
    seq_log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)
    token_log_ratio = (
        seq_log_ratio.detach().unsqueeze(-1) + inputs.logprobs - inputs.logprobs.detach()
    )
    ratio = torch.exp(token_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    cfg = inputs.config
    out = clipped_surrogate(ratio, inputs.advantages, cfg.clip_low, cfg.clip_high, clip_ratio_c=0.0)
    out.metrics["ppo_kl"] = (-seq_log_ratio.detach()).unsqueeze(-1).expand_as(mask)
    return out


@POLICY_LOSSES.register("cispo")
def compute_cispo_loss(inputs: PolicyLossInputs) -> PolicyLossOutputs:
    """CISPO: REINFORCE weighted by the importance ratio, the *weight* clipped and detached.

    loss_t = -sg(clip(r_t, 1 - low, 1 + high)) * A_t * log p_t. Unlike PPO no token's
    gradient is dropped; a token far off-policy only counts less. The MiniMax-M1 paper's
    upper-only form is ``algorithm.clip_low=1`` (a lower bound of 0, which no ratio crosses).
    """
    log_ratio = (inputs.logprobs - inputs.old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio).detach()
    low, high = 1 - inputs.config.clip_low, 1 + inputs.config.clip_high
    weight = ratio.clamp(low, high)
    token_loss = -weight * inputs.advantages * inputs.logprobs
    metrics = {
        "pg_clipfrac": ((ratio > high) | (ratio < low)).float(),
        "ppo_kl": (-log_ratio).detach(),
    }
    return PolicyLossOutputs(token_loss, metrics)


@POLICY_LOSSES.register("gmpo")
def compute_gmpo_loss(inputs: PolicyLossInputs) -> PolicyLossOutputs:
    """GMPO: the geometric mean of the token ratios replaces their arithmetic mean.

    Per response, with its advantage A (the mean of its token advantages) and s = sign(A),
    each token's log-ratio l_t is clipped to [log(1 - low), log(1 + high)] pessimistically
    (l'_t = s * min(s * l_t, s * clip(l_t))), and the loss is -A * exp(mean_t l'_t). A
    geometric mean is not dominated by one outlier token, so wider clip ranges stay stable
    (the paper clips at e^-0.4 .. e^0.4: clip_low=0.33, clip_high=0.49). Every token carries
    its response's loss: aggregate with seq-mean-token-mean to get the paper's objective.
    """
    cfg = inputs.config
    mask = inputs.loss_mask.to(inputs.logprobs.dtype)
    count = mask.sum(-1).clamp(min=1)
    log_ratio = (inputs.logprobs - inputs.old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    advantage = (inputs.advantages * mask).sum(-1) / count
    sign = torch.sign(advantage).unsqueeze(-1)
    clipped = log_ratio.clamp(math.log(max(1 - cfg.clip_low, 1e-8)), math.log(1 + cfg.clip_high))
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped)
    seq_ratio = torch.exp((pessimistic * mask).sum(-1) / count)
    seq_loss = -advantage * seq_ratio
    # A token is clipped when the clip lowered its signed log-ratio. Comparing ``pessimistic``
    # with ``log_ratio`` instead would count every token of a zero-advantage response (sign 0
    # makes ``pessimistic`` 0) as clipped, and zero-advantage groups are common.
    metrics = {
        "pg_clipfrac": (sign * log_ratio > sign * clipped).float().detach(),
        "ppo_kl": (-log_ratio).detach(),
    }
    return PolicyLossOutputs(seq_loss.unsqueeze(-1).expand_as(mask), metrics)


def compute_centred_covariance(inputs: PolicyLossInputs) -> torch.Tensor:
    """Per-token (log p - mean log p) * (A - mean A) over the loss tokens, detached.

    The entropy-mechanism paper (Cui et al., 2025) shows that entropy falls with the
    covariance between a token's log-prob and its advantage: tokens of high covariance are
    the ones that collapse it, so Clip-Cov and KL-Cov restrain exactly those.
    """
    mask = inputs.loss_mask.bool()
    logp, adv = inputs.logprobs.detach(), inputs.advantages.detach()
    if not mask.any():
        return torch.zeros_like(logp)
    centred = (logp - logp[mask].mean()) * (adv - adv[mask].mean())
    return torch.where(mask, centred, torch.zeros_like(centred))


def select_token_share(share: float, count: int) -> int:
    """How many of ``count`` tokens a share selects: at least one while there are tokens."""
    return min(count, max(1, int(share * count))) if count else 0


@POLICY_LOSSES.register("clip_cov")
def compute_clip_cov_loss(inputs: PolicyLossInputs) -> PolicyLossOutputs:
    """Clip-Cov: PPO-clip, with the gradient cut on a few high-covariance tokens.

    ``clip_cov_ratio`` of the loss tokens are drawn at random (torch's global generator)
    among those whose covariance lies in [clip_cov_lb, clip_cov_ub] and that PPO's clip has
    not already cut (their gradient is 0 anyway: drawing them would cut fewer tokens than the
    ratio asks), and their loss is removed from the gradient.
    """
    cfg = inputs.config
    out = compute_ppo_clip_loss(inputs)
    cov = compute_centred_covariance(inputs)
    mask = inputs.loss_mask.bool()
    unclipped = out.metrics["pg_clipfrac"] == 0
    in_bounds = (cov >= cfg.clip_cov_lb) & (cov <= cfg.clip_cov_ub)
    candidates = torch.nonzero((mask & unclipped & in_bounds).flatten()).squeeze(-1)
    take = min(len(candidates), select_token_share(cfg.clip_cov_ratio, int(mask.sum())))
    keep = torch.ones_like(inputs.logprobs)
    keep.view(-1)[candidates[torch.randperm(len(candidates))[:take]]] = 0.0
    out.token_loss = out.token_loss * keep
    out.metrics["cov_selected_frac"] = (1 - keep).detach()
    return out


@POLICY_LOSSES.register("kl_cov")
def compute_kl_cov_loss(inputs: PolicyLossInputs) -> PolicyLossOutputs:
    """KL-Cov: the unclipped surrogate -A r, plus kl_cov_coef * |log p - log p_old| on the
    ``kl_cov_ratio`` share of loss tokens with the largest covariance."""
    cfg = inputs.config
    log_ratio = (inputs.logprobs - inputs.old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    token_loss = -inputs.advantages * torch.exp(log_ratio)
    cov = compute_centred_covariance(inputs)
    mask = inputs.loss_mask.bool()
    take = select_token_share(cfg.kl_cov_ratio, int(mask.sum()))
    selected = torch.zeros_like(inputs.logprobs)
    if take:
        ranked = torch.where(mask, cov, torch.full_like(cov, -torch.inf)).flatten()
        selected.view(-1)[torch.topk(ranked, take).indices] = 1.0
    token_loss = token_loss + selected * cfg.kl_cov_coef * log_ratio.abs()
    metrics = {"cov_selected_frac": selected.detach(), "ppo_kl": (-log_ratio).detach()}
    return PolicyLossOutputs(token_loss, metrics)


def compute_topk_forward_kl(student_top: torch.Tensor, teacher_top: torch.Tensor) -> torch.Tensor:
    """[B, T] KL(teacher_k || student) at each position over the teacher's top K tokens:
    ``sum_k q_k (log q_k - log p_k)`` with ``q`` the teacher's top-k distribution renormalised
    (softmax of its K log-probs) and ``log p_k`` the student's full-vocabulary log-probs of
    those K tokens (``student_top``, ``teacher_top``: [B, T, K]). Its gradient moves the
    student's mass onto the teacher's likely tokens whether or not they were sampled (GKD)."""
    q_log = torch.log_softmax(teacher_top.float(), -1)
    return (q_log.exp() * (q_log - student_top)).sum(-1)


def compute_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1-k3).

    k1 = log p - log q (unbiased, high variance, can be negative); abs = |k1|;
    k2 = (log p - log q)^2 / 2; k3 = q/p - log(q/p) - 1 (unbiased, always >= 0). k3 is
    clamped to [-10, 10] as its exp() can explode on tokens the reference finds very unlikely.

    ``k1+`` / ``abs+`` / ``k3+`` (straight-through): that value with the gradient of k2. As a
    loss, k2's gradient (log p - log q) * grad log p is the unbiased estimate of the KL's
    gradient, which k1's and k3's gradients are not.
    """
    if estimator.endswith("+"):
        value = compute_kl(logprobs, ref_logprobs, estimator[:-1])
        surrogate = compute_kl(logprobs, ref_logprobs, "k2")
        return value.detach() + surrogate - surrogate.detach()
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


@dataclass
class LossScale:
    """Counts over the whole mini-batch that every micro-batch's loss is divided by."""

    tokens: float
    """Response tokens in the mini-batch, over all ranks."""
    sequences: float
    """Responses in the mini-batch with at least one loss token, over all ranks (a masked
    sample, whose loss mask is all 0, is not one)."""


def count_loss_scale(loss_mask: torch.Tensor) -> LossScale:
    """One rank's counts of its share of a mini-batch: loss tokens, and responses with at
    least one. A row with none (a masked sample, a filler row, an empty response) adds
    nothing to the loss, so it is in neither count: it must not dilute the others."""
    per_row = loss_mask.sum(-1)
    return LossScale(tokens=float(per_row.sum()), sequences=float((per_row > 0).sum()))


def aggregate_loss(
    token_loss: torch.Tensor, mask: torch.Tensor, mode: str, scale: LossScale, norm: float = 1.0
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss.

    - ``token-mean``: sum over all tokens / mini-batch tokens (every token weighs the same).
    - ``seq-mean-token-mean``: each response's token mean, summed / mini-batch responses.
    - ``seq-mean-token-sum``: each response's token sum, summed / mini-batch responses.
    - ``seq-mean-token-sum-norm``: as seq-mean-token-sum, also divided by the constant
      ``norm`` (Dr.GRPO: the max response length), so no response is weighted by its length.
    - ``token-sum``: the plain sum over all tokens (scales with the batch: tune lr with it).

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
    if mode == "seq-mean-token-sum-norm":
        return per_seq_sum.sum() / (max(scale.sequences, 1.0) * norm)
    if mode == "token-sum":
        return per_seq_sum.sum()
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {LOSS_AGGREGATIONS}")


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
    token_rewards: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, float]:
    """Subtract ``coef`` * KL from every loss token's reward.

    Returns the new rewards and the KL the adaptive controller tracks: the batch mean of each
    response's per-token mean KL (veRL's convention, so a ``kl_target`` from a veRL recipe
    means the same here; a mean of *summed* KL would grow with the response length).
    """
    mask = mask.to(old_logprobs.dtype)
    kl = compute_kl(old_logprobs, ref_logprobs, estimator) * mask
    per_token_mean = kl.sum(-1) / mask.sum(-1).clamp(min=1)
    return token_rewards - coef * kl, float(per_token_mean.mean())
