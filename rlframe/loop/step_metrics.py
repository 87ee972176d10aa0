"""A training step's metrics, from the finished Batch and the step's timer.

Names follow DESIGN.md: ``reward/*`` (see :mod:`rlframe.rewards.stage` for what each reward
quantity means), ``response_length/*``, ``rollout/*``, ``timing_s/*``, ``perf/*``.
"""

from __future__ import annotations

import torch

from rlframe.core.protocol import Batch, read_sample_mask
from rlframe.observability.tracking import StageTimer


def collect_step_metrics(
    batch: Batch,
    timer: StageTimer,
    trainer_logprobs: bool = True,
    trainer_version: int | None = None,
) -> dict[str, float]:
    """The step's metrics: rewards, lengths, rollout/trainer agreement (only when the batch's
    ``old_logprobs`` are the trainer's: ``trainer_logprobs``; see
    :func:`compute_logprob_diffs` for ``trainer_version``), timings."""
    mask = batch.tensor("loss_mask")
    # The samples that count: a masked one (its reward or env failed under on_error=mask)
    # has reward 0 that is no score and loss mask 0. A step where none counts reports all rows.
    counted = read_sample_mask(batch)
    counted = counted if counted.any() else torch.ones_like(counted)
    # Sampled tokens only: tool observations in a multi-turn response are not the policy's.
    lengths = mask.sum(1)[counted]
    rewards = batch.tensor("reward")[counted]
    finish = batch.column("finish_reason")[counted.numpy()]
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/max": float(rewards.max()),
        "reward/min": float(rewards.min()),
        "reward/score_mean": float(batch.tensor("score")[counted].mean()),
        "response_length/mean": float(lengths.float().mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(sum(r == "length" for r in finish) / len(finish)),
        "rollout/weights_version": read_weights_version(batch),
    }
    if trainer_logprobs:
        metrics |= compute_logprob_diffs(
            batch.tensor("rollout_logprobs"),
            batch.tensor("old_logprobs"),
            mask,
            read_token_versions(batch),
            trainer_version,
        )
    metrics |= collect_reward_metrics(batch, counted)
    metrics |= timer.metrics()
    tokens = float(batch.tensor("response_mask").sum() + batch.tensor("prompt_mask").sum())
    metrics["perf/tokens_per_s"] = tokens / metrics["timing_s/step"]
    return metrics


def compute_logprob_diffs(
    rollout_logprobs: torch.Tensor,
    trainer_logprobs: torch.Tensor,
    mask: torch.Tensor,
    token_versions: torch.Tensor | None,
    trainer_version: int | None,
) -> dict[str, float]:
    """The mean absolute gap between the rollout's and the trainer's log-probs of the same
    tokens, split by the weights that sampled them.

    ``rollout/logprob_diff`` covers the tokens sampled with the weights the trainer held when
    it scored them (``token_versions == trainer_version``): any gap there is numerics or a
    weight sync that did not deliver. ``rollout/logprob_diff_stale`` covers the others, whose
    gap is the policy's own movement since (asynchronous training). With ``trainer_version``
    None (lockstep) every token is current and there is no stale metric. Otherwise a metric
    whose set has no tokens is left out: a step that trains only on stale tokens checks no
    sync, and must not read as a clean one.

    ``rollout/logprob_diff_row_max`` is the largest per-row mean gap over the current tokens:
    a corruption that hits few rows (one routed expert, the image rows) is diluted in the
    mean and not in its rows'.
    """
    gap = (rollout_logprobs - trainer_logprobs).abs()
    mask = mask.bool()
    if trainer_version is None:
        if not mask.any():
            return {"rollout/logprob_diff": 0.0}
        return {"rollout/logprob_diff": float(gap[mask].mean())} | compute_row_max(gap, mask)
    current = mask
    if token_versions is not None:
        current = mask & (token_versions == trainer_version)
    stale = mask & ~current
    sets = {"rollout/logprob_diff": current, "rollout/logprob_diff_stale": stale}
    out = {name: float(gap[s].mean()) for name, s in sets.items() if s.any()}
    return out | (compute_row_max(gap, current) if current.any() else {})


def compute_row_max(gap: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``rollout/logprob_diff_row_max``: the largest mean of ``gap`` over one row's ``mask``
    tokens, among the rows that have any."""
    counts = mask.sum(1)
    rows = torch.where(mask, gap, 0.0).sum(1)[counts > 0] / counts[counts > 0]
    return {"rollout/logprob_diff_row_max": float(rows.max())}


def read_token_versions(batch: Batch) -> torch.Tensor | None:
    """The weights version of each response token, ``[rows, width]``: ``token_version``
    where the producer kept one per token, else each row's ``weights_version`` on all its
    tokens; None when the batch carries neither."""
    if "token_version" in batch.tensors:
        return batch.tensor("token_version")
    if "weights_version" in batch.tensors:
        return batch.tensor("weights_version").unsqueeze(1).expand_as(batch.tensor("loss_mask"))
    return None


def collect_reward_metrics(batch: Batch, counted: torch.Tensor | None = None) -> dict[str, float]:
    """Failed and retried rule-reward samples (counts, of every row) and the means of the
    reward's parts over the rows ``counted`` (all when None), when present."""
    metrics: dict[str, float] = {}
    for key, name in (
        ("reward_errors", "reward/errors"),
        ("reward_timeouts", "reward/timeouts"),
        ("reward_retries", "reward/retries"),
    ):
        if key in batch.tensors:
            metrics[name] = float(batch.tensor(key).sum())
    rows = counted if counted is not None else torch.ones(len(batch), dtype=torch.bool)
    for key, name in (("rule_score", "reward/rule_mean"), ("rm_score", "reward/model_mean")):
        if key in batch.tensors:
            metrics[name] = float(batch.tensor(key)[rows].float().mean())
    return metrics


def read_weights_version(batch: Batch) -> float:
    """The mean weights version the batch's rows were generated with: the per-row
    ``weights_version`` column, or the batch-level meta value of engines that set only that."""
    if "weights_version" in batch.tensors:
        return float(batch.tensor("weights_version").float().mean())
    return float(batch.meta.get("weights_version", 0))
