"""Advantage estimators: pure tensor functions from rewards to per-token advantages.

Each estimator takes :class:`AdvantageInputs` and returns :class:`AdvantageOutputs`; it never
sees workers or process groups. Register new ones with ``@ADVANTAGES.register("name")`` or
point ``algorithm.advantage`` at ``pkg.module:function``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlframe.algorithms.registry import Registry
from rlframe.config import AlgorithmConfig

EPS = 1e-6


@dataclass
class AdvantageInputs:
    rewards: torch.Tensor
    """[B] one scalar reward per response."""
    response_mask: torch.Tensor
    """[B, T] 1 on response tokens that count, 0 on padding."""
    group_index: torch.Tensor
    """[B] integer id of the prompt each response answers (its group)."""
    config: AlgorithmConfig


@dataclass
class AdvantageOutputs:
    advantages: torch.Tensor
    """[B, T] per-token advantages, 0 outside the response mask."""
    returns: torch.Tensor
    """[B, T] per-token returns (targets for a critic; equal to advantages without one)."""
    metrics: dict[str, float] = field(default_factory=dict)


AdvantageFn = Callable[[AdvantageInputs], AdvantageOutputs]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage")


def compute_group_stats(values: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response mean, unbiased std and size of its group.

    A group of one has std 0 (there is no spread to measure), never NaN.
    """
    _, inverse = torch.unique(group_index, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    values = values.double()
    count = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(values))
    total = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, values)
    mean = total / count
    squares = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, (values - mean[inverse]) ** 2)
    std = torch.sqrt(squares / (count - 1).clamp(min=1))
    return mean[inverse], std[inverse], count[inverse]


@ADVANTAGES.register("grpo")
def compute_grpo_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """GRPO: each response's reward minus its group's mean, over the group's std.

    ``norm_by_std=False`` keeps the mean-centred reward (Dr.GRPO), which does not up-weight
    groups whose rewards barely differ. A group whose rewards are all equal (or a group of
    one) gets advantage 0: it carries no signal about which response is better.
    """
    mean, std, _ = compute_group_stats(inputs.rewards, inputs.group_index)
    centred = inputs.rewards.double() - mean
    scores = centred / (std + EPS) if inputs.config.norm_by_std else centred
    mask = inputs.response_mask.to(torch.float32)
    advantages = scores.to(torch.float32).unsqueeze(1) * mask
    return AdvantageOutputs(advantages, advantages.clone(), {"zero_std_frac": float((std == 0).float().mean())})
