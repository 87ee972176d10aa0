"""The policy's training objective, composed from its terms: pure tensor code.

One micro-batch's loss is the policy loss (``algorithm.policy_loss``: the ratio against the
old policy that ``algorithm.off_policy_correction`` picks, and its clipping), each token
weighted by the correction's constant weight (decoupled PPO's pi_prox / pi_behav, or the
mismatch weights of ``tis_cap`` / ``mismatch_mask``), aggregated (``algorithm.loss_agg``),
minus the entropy bonus, plus the KL penalty to the reference. The training role computes the
log-probs and the entropy, calls :func:`compose_policy_loss`, and runs the backward and the
collectives; everything in between is here, testable on CPU with numbers worked by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlframe.algorithms.losses import (
    POLICY_LOSSES,
    LossScale,
    PolicyLossFn,
    PolicyLossInputs,
    aggregate_loss,
    compute_kl,
    compute_topk_forward_kl,
    masked_mean,
)
from rlframe.algorithms.mismatch import compute_mismatch_weights, is_mismatch_correction_on
from rlframe.algorithms.off_policy import OldLogprobs, compute_behaviour_weights, pick_old_logprobs
from rlframe.core.names import OffPolicyCorrection

if TYPE_CHECKING:
    from rlframe.config import AlgorithmConfig


@dataclass
class PolicyTerms:
    """One micro-batch's tensors that the objective reads, each ``[B, T]``."""

    logprobs: torch.Tensor
    """The policy's log-probs of the response tokens, with their gradient."""
    entropy: torch.Tensor
    """The policy's per-token entropy (with its gradient when ``entropy_coef > 0``)."""
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    """1 on the tokens the policy sampled (padding and tool observations 0)."""
    scale: LossScale
    """The whole mini-batch's counts that the aggregation divides by."""
    old_logprobs: torch.Tensor | None = None
    """The trainer's log-probs before the update; None when the update is exactly on-policy
    and takes its own (detached)."""
    rollout_logprobs: torch.Tensor | None = None
    """The rollout engine's log-probs (read by the ``rollout`` and ``decoupled`` corrections
    and by the mismatch weights)."""
    ref_logprobs: torch.Tensor | None = None
    """The reference policy's log-probs (read when ``kl_coef > 0``)."""
    teacher_logprobs: torch.Tensor | None = None
    """A distillation teacher's log-probs of the response tokens (read with a
    :class:`DistillTerm`)."""
    teacher_top_logprobs: torch.Tensor | None = None
    """[B, T, K] the teacher's top-k log-probs at each position (``topk_forward_kl``)."""
    student_top_logprobs: torch.Tensor | None = None
    """[B, T, K] the policy's log-probs of those K ids, with their gradient."""


TOPK_FORWARD_KL = "topk_forward_kl"
"""The :class:`DistillTerm` estimator over the teacher's top-k (GKD)."""


@dataclass(frozen=True)
class DistillTerm:
    """On-policy distillation as a loss term, aggregated like the policy loss: ``coef`` x
    KL(policy || teacher) on the sampled tokens by ``estimator`` ``k1`` or ``k3`` (as the
    reference KL's), or x KL(teacher's top-k || policy) at each position
    (``topk_forward_kl``)."""

    coef: float
    estimator: str


@dataclass
class ComposedLoss:
    """The micro-batch's share of the mini-batch loss and what it reports."""

    loss: torch.Tensor
    """Scalar, with the gradient the backward follows."""
    metrics: dict[str, float]
    """``actor/*``: pg_loss, entropy, kl (with a KL term), and the policy loss's and the
    correction's per-token metrics, each averaged over the loss tokens."""
    old_logprobs: torch.Tensor
    """The old policy the ratio was taken against (detached)."""


def select_old_logprobs(terms: PolicyTerms, correction: OffPolicyCorrection) -> torch.Tensor:
    """The old policy of the ratio (:func:`~rlframe.algorithms.off_policy.pick_old_logprobs`):
    the rollout's log-probs, else the trainer's recomputed ones, else (an exactly on-policy
    update) the policy's own, detached."""
    source = pick_old_logprobs(correction, recomputed=terms.old_logprobs is not None)
    if source is OldLogprobs.rollout:
        return require_term(terms.rollout_logprobs, "rollout_logprobs", correction.value)
    if source is OldLogprobs.update:
        return terms.logprobs.detach()
    return require_term(terms.old_logprobs, "old_logprobs", correction.value)


def compute_correction_weights(
    old_logprobs: torch.Tensor, terms: PolicyTerms, cfg: AlgorithmConfig
) -> dict[str, torch.Tensor]:
    """The constant per-token weight of the correction, by metric name: ``behav_weight``
    (decoupled), ``mismatch_weight`` (tis_cap / mismatch_mask), or none."""
    if cfg.off_policy_correction is OffPolicyCorrection.decoupled:
        rollout = require_term(terms.rollout_logprobs, "rollout_logprobs", "decoupled")
        # old_logprobs are the proximal policy's; the rollout's are the behaviour policy's.
        weights = compute_behaviour_weights(
            old_logprobs, rollout, terms.loss_mask, cfg.behav_weight_cap
        )
        return {"behav_weight": weights}
    if is_mismatch_correction_on(cfg):
        rollout = require_term(terms.rollout_logprobs, "rollout_logprobs", "tis_cap")
        return {
            "mismatch_weight": compute_mismatch_weights(old_logprobs, rollout, terms.loss_mask, cfg)
        }
    return {}


def compose_policy_loss(
    terms: PolicyTerms,
    cfg: AlgorithmConfig,
    policy_loss: PolicyLossFn | None = None,
    distill: DistillTerm | None = None,
) -> ComposedLoss:
    """The micro-batch's loss: policy loss x correction weight, aggregated, minus
    ``entropy_coef`` x entropy, plus ``kl_coef`` x KL(policy || reference) and, distilling,
    ``distill.coef`` x KL(policy || teacher), every term aggregated the same way.
    ``policy_loss``: the registered ``algorithm.policy_loss`` (looked up when None)."""
    loss_fn = policy_loss or POLICY_LOSSES.get(cfg.policy_loss)
    mask = terms.loss_mask
    old = select_old_logprobs(terms, cfg.off_policy_correction)
    out = loss_fn(PolicyLossInputs(terms.logprobs, old, terms.advantages, mask, cfg))
    token_loss = out.token_loss
    for name, weights in compute_correction_weights(old, terms, cfg).items():
        token_loss = token_loss * weights
        out.metrics[name] = weights

    def aggregate(values: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(values, mask, cfg.loss_agg, terms.scale, cfg.loss_agg_norm)

    loss = aggregate(token_loss)
    metrics = {"actor/pg_loss": float(masked_mean(token_loss.detach(), mask))}
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * aggregate(terms.entropy)
    metrics["actor/entropy"] = float(masked_mean(terms.entropy.detach(), mask))
    if cfg.kl_coef > 0:
        ref = require_term(terms.ref_logprobs, "ref_logprobs", "kl_coef > 0")
        kl = compute_kl(terms.logprobs, ref, cfg.kl_estimator)
        loss = loss + cfg.kl_coef * aggregate(kl)
        metrics["actor/kl"] = float(masked_mean(kl.detach(), mask))
    if distill is not None:
        if distill.estimator == TOPK_FORWARD_KL:
            kl = compute_topk_forward_kl(
                require_term(terms.student_top_logprobs, "student_top_logprobs", "top-k KL"),
                require_term(terms.teacher_top_logprobs, "teacher_top_logprobs", "top-k KL"),
            )
        else:
            teacher = require_term(terms.teacher_logprobs, "teacher_logprobs", "distillation")
            kl = compute_kl(terms.logprobs, teacher, distill.estimator)
        loss = loss + distill.coef * aggregate(kl)
        metrics["actor/distill_kl"] = float(masked_mean(kl.detach(), mask))
    for name, value in out.metrics.items():
        metrics[f"actor/{name}"] = float(masked_mean(value, mask))
    return ComposedLoss(loss, metrics, old.detach())


def require_term(value: torch.Tensor | None, name: str, reader: str) -> torch.Tensor:
    """A term the configuration reads; its absence is a caller's bug, named."""
    if value is None:
        raise ValueError(f"the policy objective needs {name} for {reader}")
    return value
