"""Corrections for the rollout/trainer mismatch: truncated and masked importance sampling.

The responses were sampled by the rollout engine (vLLM), whose kernels and dtype differ from
the trainer's, so pi_rollout != pi_old even with the same weights. With
r = pi_old / pi_rollout per token (from the two engines' log-probs of the same tokens):

- truncated IS (TIS, ``algorithm.tis_cap``): the loss is weighted by min(r, cap), per token
  or, at ``tis_level=sequence``, by min(prod_t r_t, cap) for every token of a response;
- masked IS (``algorithm.mismatch_mask``, IcePop-style rejection): tokens whose r lies
  outside [mismatch_low, mismatch_high], or, at ``sequence`` level, whole responses whose
  geometric-mean ratio does, are dropped from the gradient. The loss is still normalised by
  all loss tokens, so dropping a token never changes another token's weight.

Weights are computed from detached log-probs and held constant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlframe.algorithms.losses import MAX_LOG_RATIO

if TYPE_CHECKING:
    from rlframe.config import AlgorithmConfig


def is_mismatch_correction_on(cfg: AlgorithmConfig) -> bool:
    return cfg.tis_cap > 0 or cfg.mismatch_mask != "off"


def compute_log_ratio(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """log(pi_old / pi_rollout) per loss token, 0 elsewhere."""
    diff = (old_logprobs.detach() - rollout_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return diff * mask.to(diff.dtype)


def compute_sequence_log_ratio(
    log_ratio: torch.Tensor, mask: torch.Tensor, geometric: bool
) -> torch.Tensor:
    """[B, 1] log of each response's ratio: the sum over its tokens, or their mean (geometric)."""
    total = log_ratio.sum(-1, keepdim=True)
    return total / mask.sum(-1, keepdim=True).clamp(min=1) if geometric else total


def compute_mismatch_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmConfig,
) -> torch.Tensor:
    """[B, T] constant weights (TIS weight times the keep mask) to multiply the token loss by."""
    mask = mask.to(old_logprobs.dtype)
    log_ratio = compute_log_ratio(old_logprobs, rollout_logprobs, mask)
    weights = torch.ones_like(log_ratio)
    if cfg.tis_cap > 0:
        level = (
            log_ratio
            if cfg.tis_level == "token"
            else compute_sequence_log_ratio(log_ratio, mask, geometric=False)
        )
        weights = weights * torch.exp(level.clamp(max=MAX_LOG_RATIO)).clamp(max=cfg.tis_cap)
    if cfg.mismatch_mask != "off":
        weights = weights * compute_keep_mask(log_ratio, mask, cfg)
    return weights.expand_as(log_ratio) * mask


def compute_keep_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, cfg: AlgorithmConfig
) -> torch.Tensor:
    """1 where the token (or its response's geometric-mean ratio) is inside the band."""
    level = (
        log_ratio
        if cfg.mismatch_mask == "token"
        else compute_sequence_log_ratio(log_ratio, mask, geometric=True)
    )
    ratio = torch.exp(level)
    inside = (ratio >= cfg.mismatch_low) & (ratio <= cfg.mismatch_high)
    return inside.to(log_ratio.dtype).expand_as(log_ratio)


def compute_mismatch_metrics(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmConfig,
) -> dict[str, float]:
    """Whole-batch ``mismatch/*`` metrics: the ratio's mean and max over loss tokens, the KL
    between the engines (k3 estimate of KL(rollout || trainer) from the rollout's samples),
    and, where the corrections are on, the share of tokens they drop or clip."""
    mask = mask.to(old_logprobs.dtype)
    count = mask.sum().clamp(min=1)
    log_ratio = compute_log_ratio(old_logprobs, rollout_logprobs, mask)
    ratio = torch.exp(log_ratio)
    on = mask.bool()
    metrics = {
        "mismatch/ratio_mean": float((ratio * mask).sum() / count),
        "mismatch/ratio_max": float(ratio[on].max()) if on.any() else 1.0,
        "mismatch/kl": float(((ratio - log_ratio - 1) * mask).sum() / count),
    }
    if cfg.mismatch_mask != "off":
        keep = compute_keep_mask(log_ratio, mask, cfg)
        metrics["mismatch/masked_frac"] = float(((1 - keep) * mask).sum() / count)
    if cfg.tis_cap > 0:
        level = (
            log_ratio
            if cfg.tis_level == "token"
            else compute_sequence_log_ratio(log_ratio, mask, geometric=False)
        )
        clipped = (
            (torch.exp(level.clamp(max=MAX_LOG_RATIO)) > cfg.tis_cap).to(mask.dtype).expand_as(mask)
        )
        metrics["mismatch/tis_clipfrac"] = float((clipped * mask).sum() / count)
    return metrics
