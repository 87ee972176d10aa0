"""A training step's metrics, from the finished Batch and the step's timer.

Names follow DESIGN.md: ``reward/*`` (see :mod:`rlframe.rewards.stage` for what each reward
quantity means), ``response_length/*``, ``rollout/*``, ``timing_s/*``, ``perf/*``.
"""

from __future__ import annotations

from rlframe.protocol import Batch
from rlframe.tracking import StageTimer


def collect_step_metrics(
    batch: Batch, timer: StageTimer, trainer_logprobs: bool = True
) -> dict[str, float]:
    """The step's metrics: rewards, lengths, rollout/trainer agreement (only when the batch's
    ``old_logprobs`` are the trainer's: ``trainer_logprobs``), timings."""
    mask = batch["loss_mask"]
    # Sampled tokens only: tool observations in a multi-turn response are not the policy's.
    lengths = mask.sum(1)
    rewards = batch["reward"]
    # Same tokens, same weights: any gap is numerics or a stale weight sync.
    diff = (
        (batch["rollout_logprobs"] - batch["old_logprobs"]).abs() * mask
    ).sum() / mask.sum().clamp(min=1)
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/max": float(rewards.max()),
        "reward/min": float(rewards.min()),
        "reward/score_mean": float(batch["score"].mean()),
        "response_length/mean": float(lengths.float().mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(
            sum(r == "length" for r in batch["finish_reason"]) / len(batch)
        ),
        "rollout/weights_version": read_weights_version(batch),
    }
    if trainer_logprobs:
        metrics["rollout/logprob_diff"] = float(diff)
    metrics |= collect_reward_metrics(batch)
    metrics |= timer.metrics()
    tokens = float(batch["response_mask"].sum() + batch["prompt_mask"].sum())
    metrics["perf/tokens_per_s"] = tokens / metrics["timing_s/step"]
    return metrics


def collect_reward_metrics(batch: Batch) -> dict[str, float]:
    """Failed rule-reward samples (counts) and the means of the reward's parts, when present."""
    metrics = {}
    for key, name in (("reward_errors", "reward/errors"), ("reward_timeouts", "reward/timeouts")):
        if key in batch.tensors:
            metrics[name] = float(batch[key].sum())
    for key, name in (("rule_score", "reward/rule_mean"), ("rm_score", "reward/model_mean")):
        if key in batch.tensors:
            metrics[name] = float(batch[key].float().mean())
    return metrics


def read_weights_version(batch: Batch) -> float:
    """The mean weights version the batch's rows were generated with: the per-row
    ``weights_version`` column, or the batch-level meta value of engines that set only that."""
    if "weights_version" in batch.tensors:
        return float(batch["weights_version"].float().mean())
    return float(batch.meta.get("weights_version", 0))
