"""Groups of rows: DAPO's test for a group that teaches nothing, and joining groups.

A group (the ``n`` responses to one prompt) whose rewards are all equal gives GRPO-style
advantages of 0: it costs an update and teaches nothing. With ``algorithm.dynamic_sampling``
the producer drops such a group when it finishes and admits another prompt in its place
(:meth:`rlframe.rollout.producer.ExperienceProducer.score`).
"""

from __future__ import annotations

import torch

from rlframe.core.protocol import ROUTED_EXPERTS, Batch
from rlframe.models.moe_routing import left_pad_routed_experts


def has_uniform_rewards(group: Batch) -> bool:
    """Whether every row of a scored group has the same reward."""
    return not bool((group.tensor("reward") != group.tensor("reward")[0]).any())


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
