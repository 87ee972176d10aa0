"""Bounded staleness as pure functions: which groups may still train, which a step takes,
how many new groups may start, and the ``off_policy/*`` metrics.

Words: a group's *oldest version* is the weights version of its oldest token (every token
records the version it was sampled with). An update that starts from weights version ``V``
may use a group only while ``V - oldest <= k`` (``rollout.max_staleness``). A group is *due*
at ``V`` when this update is its last chance: after the next sync it would be over the bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupView:
    """What selection needs to know of one group in flight."""

    group_id: int
    """Admission order (the prompt's group index); ties are broken by it."""
    oldest_version: int
    """Weights version of the group's oldest token."""
    finished: bool
    """Every response of the group is complete (and scored)."""


def is_within_bound(oldest_version: int, current_version: int, max_staleness: int) -> bool:
    """Whether an update starting from ``current_version`` may use a group."""
    return current_version - oldest_version <= max_staleness


def is_due(oldest_version: int, current_version: int, max_staleness: int) -> bool:
    """Whether the update at ``current_version`` is the group's last one within the bound."""
    return current_version - oldest_version >= max_staleness


def find_over_bound(
    groups: Sequence[GroupView], current_version: int, max_staleness: int
) -> list[int]:
    """Ids of the groups no update from ``current_version`` on may use."""
    return [
        g.group_id
        for g in groups
        if not is_within_bound(g.oldest_version, current_version, max_staleness)
    ]


def select_step_groups(
    groups: Sequence[GroupView],
    wanted: int,
    current_version: int,
    max_staleness: int,
    wait_for_due: bool,
) -> list[int] | None:
    """The ids of the ``wanted`` groups this step trains on, or None while it must wait.

    Earliest deadline first: finished groups by (oldest version, group id). With
    ``wait_for_due`` (``rollout.stale_groups=wait``) the step also waits while a due group
    is unfinished, so that no group ever goes over the bound; without it (``drop``) the step
    takes the first ``wanted`` finished groups within the bound and due stragglers will be
    dropped later. Groups over the bound are never selected (drop them first).
    """
    usable = [
        g for g in groups if is_within_bound(g.oldest_version, current_version, max_staleness)
    ]
    if wait_for_due and any(
        not g.finished and is_due(g.oldest_version, current_version, max_staleness) for g in usable
    ):
        return None
    finished = sorted(
        (g for g in usable if g.finished), key=lambda g: (g.oldest_version, g.group_id)
    )
    if len(finished) < wanted:
        return None
    return [g.group_id for g in finished[:wanted]]


def count_admissible(admitted: int, steps_done: int, batch_groups: int, max_staleness: int) -> int:
    """How many new groups may start now.

    A group started while ``s`` steps are done (weights version ``s``) must be trained by the
    update of step ``s + k + 1`` at the latest. Each step trains ``batch_groups`` groups, so
    at most ``batch_groups * (s + k + 1)`` groups may ever have started by then, dropped ones
    not counted (``admitted``): earliest-deadline-first selection then meets every deadline.
    At ``k = 0`` this is exactly one step's groups at a time: lockstep.
    """
    return max(0, batch_groups * (steps_done + max_staleness + 1) - admitted)


def compute_off_policy_metrics(
    token_version: torch.Tensor,
    mask: torch.Tensor,
    current_version: int,
    dropped: int,
) -> dict[str, float]:
    """``off_policy/*`` of the rows a step trains on.

    ``token_version`` ``[rows, width]`` holds each response token's weights version, ``mask``
    marks the real tokens. Staleness of a row: ``current_version`` minus its oldest token's
    version; version span: its newest minus its oldest; a partial response is one whose
    tokens span more than one version (it crossed a sync).
    """
    real = mask.bool()
    big = torch.iinfo(torch.long).max
    oldest = torch.where(real, token_version, big).min(1).values
    newest = torch.where(real, token_version, -1).max(1).values
    has_tokens = real.any(1)
    # A row without tokens (an empty response) came from the version its call ran with;
    # the caller puts that version in every column of the row.
    oldest = torch.where(has_tokens, oldest, token_version[:, 0])
    newest = torch.where(has_tokens, newest, token_version[:, 0])
    staleness = (current_version - oldest).float()
    span = (newest - oldest).float()
    return {
        "off_policy/staleness_mean": float(staleness.mean()),
        "off_policy/staleness_max": float(staleness.max()),
        "off_policy/version_span_mean": float(span.mean()),
        "off_policy/partial_frac": float((span > 0).float().mean()),
        "off_policy/dropped": float(dropped),
    }
