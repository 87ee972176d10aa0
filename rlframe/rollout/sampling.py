"""DAPO's dynamic sampling as pure functions: rounds of drawing, keeping informative groups.

A group (the ``n`` responses to one prompt) whose rewards are all equal gives GRPO-style
advantages of 0: it costs an update and teaches nothing. Dynamic sampling draws rounds of
prompts until ``wanted`` groups with differing rewards are in, then tops up with uniform
groups only if the rounds ran out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlframe.moe_routing import ROUTED_EXPERTS, left_pad_routed_experts
from rlframe.protocol import Batch

PROMPT_TENSORS = ("prompt_ids", "prompt_mask")


def split_uniform_groups(batch: Batch, n: int) -> tuple[list[Batch], list[Batch]]:
    """The batch's groups (n consecutive rows each), split by whether their rewards differ."""
    informative: list[Batch] = []
    uniform: list[Batch] = []
    for group in batch.split(n):
        (
            informative
            if bool((group.tensor("reward") != group.tensor("reward")[0]).any())
            else uniform
        ).append(group)
    return informative, uniform


def select_groups(informative: list[Batch], uniform: list[Batch], wanted: int) -> list[Batch]:
    """The groups a step trains on: informative ones first, in the order they were drawn,
    uniform ones only to top up; never more than ``wanted``."""
    return (informative + uniform)[:wanted]


def concat_groups(groups: list[Batch]) -> Batch:
    """Rows of all groups in order. Rounds pad their prompts to different widths: left-pad
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


def run_sampling_rounds(
    draw: Callable[[], Batch], n: int, wanted: int, max_rounds: int
) -> tuple[Batch, dict[str, float]]:
    """Call ``draw`` (a generated and scored batch of groups) until ``wanted`` informative
    groups are in or ``max_rounds`` rounds are spent; returns the step's batch and
    ``rollout/sampling_rounds``, ``rollout/kept_group_frac`` (informative share of all drawn)."""
    kept: list[Batch] = []
    dropped: list[Batch] = []
    rounds = 0
    while rounds < max_rounds:
        rounds += 1
        informative, uniform = split_uniform_groups(draw(), n)
        kept += informative
        dropped += uniform
        if len(kept) >= wanted:
            break
    metrics = {
        "rollout/sampling_rounds": float(rounds),
        "rollout/kept_group_frac": len(kept) / max(1, len(kept) + len(dropped)),
    }
    # Still short after the last round: uniform groups carry no GRPO-style signal but keep
    # the batch the size the update's mini-batches expect.
    return concat_groups(select_groups(kept, dropped, wanted)), metrics
