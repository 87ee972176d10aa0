"""Groups of rows: DAPO's test for a group that teaches nothing, masked samples, and joining
groups.

A group (the ``n`` responses to one prompt) whose rewards are all equal gives GRPO-style
advantages of 0: it costs an update and teaches nothing. With ``algorithm.dynamic_sampling``
the producer drops such a group when it finishes and admits another prompt in its place
(:meth:`rlframe.rollout.producer.ExperienceProducer.score`).

A group that masking (``reward.on_error=mask``, ``agent.on_env_error=mask``) left with fewer
than 2 samples that count (none, for a group of one) has no group statistics to compare a
sample with: the producer drops it and admits another prompt likewise, up to
``data.batch_size`` of them a step; past that it is kept with every row masked
(:func:`mask_group`), so it adds nothing to the loss or its token counts.
"""

from __future__ import annotations

import torch

from rlframe.core.protocol import ROUTED_EXPERTS, SAMPLE_MASK, Batch, read_sample_mask
from rlframe.models.moe_routing import left_pad_routed_experts


def has_uniform_rewards(group: Batch) -> bool:
    """Whether every row of a scored group that counts (masked ones left out) has the same
    reward."""
    rewards = group.tensor("reward")[read_sample_mask(group)]
    return not bool((rewards != rewards[:1]).any())


def is_short_of_samples(group: Batch) -> bool:
    """Whether masking left a scored group fewer than 2 samples that count (none, for a group
    of one)."""
    return int(read_sample_mask(group).sum()) < min(2, len(group))


def mask_group(group: Batch) -> Batch:
    """The group with every row masked: sample mask 0, loss mask all 0."""
    return group.with_tensors(
        **{SAMPLE_MASK: torch.zeros(len(group))},
        loss_mask=torch.zeros_like(group.tensor("loss_mask")),
    )


def count_masked_samples(scored: Batch, env_masks: bool) -> dict[str, int]:
    """A scored batch's rows (``samples``) and its masked ones by cause: ``env_masked``
    (the env failed, under ``agent.on_env_error=mask``: ``env_masks``) and ``reward_masked``
    (the others: the rule reward failed under ``reward.on_error=mask``)."""
    masked = ~read_sample_mask(scored)
    env_masked = 0
    if env_masks and "env_failed" in scored:
        env_masked = int((masked & scored.tensor("env_failed").bool()).sum())
    return {
        "samples": len(scored),
        "env_masked": env_masked,
        "reward_masked": int(masked.sum()) - env_masked,
    }


def collect_masking_metrics(
    counts: dict[str, int], reward_masks: bool, env_masks: bool
) -> dict[str, float]:
    """The step's masking metrics from the producer's counts since the last batch (every
    sample scored, dropped groups' too): ``reward/masked`` (under ``reward.on_error=mask``)
    and ``agent/masked`` (under ``agent.on_env_error=mask``), fractions of the samples;
    ``rollout/masked_groups_dropped`` (replaced by another prompt) and
    ``rollout/masked_groups_kept`` (past the step's budget, every row masked)."""
    samples = max(counts["samples"], 1)
    metrics = {
        "rollout/masked_groups_dropped": float(counts["masked_replaced"]),
        "rollout/masked_groups_kept": float(counts["masked_kept"]),
    }
    if reward_masks:
        metrics["reward/masked"] = counts["reward_masked"] / samples
    if env_masks:
        metrics["agent/masked"] = counts["env_masked"] / samples
    return metrics


def collect_sampling_metrics(counts: dict[str, int]) -> dict[str, float]:
    """DAPO's step metrics from the producer's counts since the last batch (``informative``,
    ``uniform``, ``replaced`` groups): ``rollout/uniform_dropped``, and
    ``rollout/kept_group_frac`` once a group was scored."""
    metrics = {"rollout/uniform_dropped": float(counts["replaced"])}
    if counts["informative"] + counts["uniform"]:  # groups scored since the last batch
        scored = counts["informative"] + counts["uniform"]
        metrics["rollout/kept_group_frac"] = counts["informative"] / scored
    return metrics


def concat_groups(groups: list[Batch]) -> Batch:
    """Rows of all groups in order. Groups pad their prompts to different widths: left-pad
    the prompt tensors to the widest first (responses share one width already)."""
    if "prompt_ids" not in groups[0]:
        return Batch.concat(groups)
    width = max(g.tensor("prompt_ids").shape[1] for g in groups)
    pad_id = int(groups[0].meta.get("pad_token_id", 0))

    def widen(g: Batch) -> Batch:
        extra = width - g.tensor("prompt_ids").shape[1]
        ids = torch.nn.functional.pad(g.tensor("prompt_ids"), (extra, 0), value=pad_id)
        g = g.with_tensors(
            prompt_ids=ids, prompt_mask=torch.nn.functional.pad(g.tensor("prompt_mask"), (extra, 0))
        )
        if ROUTED_EXPERTS in g.tensors:  # aligned with prompt + response: padded alike
            g = g.with_tensors(
                **{ROUTED_EXPERTS: left_pad_routed_experts(g.tensor(ROUTED_EXPERTS), extra)}
            )
        return g

    return Batch.concat([widen(g) for g in groups])
