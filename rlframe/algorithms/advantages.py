"""Advantage estimators: pure tensor functions from rewards to per-token advantages.

Each estimator takes :class:`AdvantageInputs` and returns :class:`AdvantageOutputs`; it never
sees workers or process groups. Register new ones with ``@ADVANTAGES.register("name")`` or
point ``algorithm.advantage`` at ``pkg.module:function``.

Masked samples (``AdvantageInputs.sample_mask`` 0: a reward or env that failed under
``reward.on_error=mask`` / ``agent.on_env_error=mask``) carry reward 0 and an all-zero
``loss_mask``. Every statistic over samples leaves them out: group means and stds
(:func:`compute_group_stats` with the mask), leave-one-out baselines, batch whitening (over
``loss_mask``, which they are not in); their advantages are 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from math import comb
from typing import TYPE_CHECKING

import torch

from rlframe.core.registry import Registry

if TYPE_CHECKING:
    from rlframe.config import AlgorithmConfig

EPS = 1e-6


@dataclass
class AdvantageInputs:
    rewards: torch.Tensor
    """[B] one scalar reward per response (the sum of ``token_rewards`` when those are given)."""
    loss_mask: torch.Tensor
    """[B, T] 1 on response tokens the policy sampled, 0 on padding (and tool observations)."""
    group_index: torch.Tensor
    """[B] integer id of the prompt each response answers (its group)."""
    config: AlgorithmConfig
    token_rewards: torch.Tensor | None = None
    """[B, T] per-token rewards: the score on the last token, minus any in-reward KL penalty.
    None means the score alone, on the last token."""
    values: torch.Tensor | None = None
    """[B, T] critic values of the states before each response token (GAE)."""
    baseline: torch.Tensor | None = None
    """[B] reward of the greedy response to the same prompt (ReMax)."""
    sample_mask: torch.Tensor | None = None
    """[B] 1 for a sample that counts, 0 for a masked one (its reward or env failed under
    ``on_error=mask``): its reward is 0 and not a score, its ``loss_mask`` is all 0, and it
    must stay out of every statistic over samples. None: every sample counts."""

    def valid(self) -> torch.Tensor:
        """[B] bool: the samples that count (:attr:`sample_mask`, or all)."""
        if self.sample_mask is None:
            return torch.ones(len(self.rewards), dtype=torch.bool)
        return self.sample_mask.bool()

    def per_token_rewards(self) -> torch.Tensor:
        if self.token_rewards is not None:
            return self.token_rewards.float()
        return place_on_last_token(self.rewards.float(), self.loss_mask)


@dataclass
class AdvantageOutputs:
    advantages: torch.Tensor
    """[B, T] per-token advantages, 0 outside the response mask."""
    returns: torch.Tensor
    """[B, T] per-token returns (targets for a critic; equal to advantages without one)."""
    metrics: dict[str, float] = field(default_factory=dict)


AdvantageFn = Callable[[AdvantageInputs], AdvantageOutputs]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage")


def place_on_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] scores -> [B, T] zeros with each score on its response's last masked token.

    The last 1 of the mask, not its count: a multi-turn loss mask has gaps (observations).
    A zero-length response has no token to carry its score and gets none.
    """
    out = torch.zeros(mask.shape, dtype=torch.float32)
    present = mask > 0
    rows = torch.nonzero(present.any(-1)).squeeze(-1)
    positions = torch.arange(mask.shape[-1]).expand(mask.shape)
    last = torch.where(present, positions, -1).max(-1).values
    out[rows, last[rows]] = scores[rows].float()
    return out


def whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Shift and scale to zero mean and unit variance over the masked entries of the batch."""
    mask = mask.to(values.dtype)
    count = mask.sum().clamp(min=1)
    mean = (values * mask).sum() / count
    var = (((values - mean) * mask) ** 2).sum() / count
    return (values - mean) * torch.rsqrt(var + 1e-8) * mask


def compute_reverse_cumsum(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over the masked response tokens.

    Unmasked tokens are skipped, not zeroed: the return flows across a multi-turn response's
    observations into the earlier turns (after the response, padding holds it at 0).
    """
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask


def broadcast_scores(scores: torch.Tensor, mask: torch.Tensor) -> AdvantageOutputs:
    advantages = scores.float().unsqueeze(1) * mask.float()
    return AdvantageOutputs(advantages, advantages.clone())


def compute_group_stats(
    values: torch.Tensor, group_index: torch.Tensor, sample_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response mean, unbiased std and size of its group, over the group's samples that
    count (``sample_mask``; all when None): a masked sample is in no group's statistics, and
    gets those of its group's other samples.

    A group of one has std 0 (there is no spread to measure), never NaN; a group with no
    sample that counts has mean 0, std 0 and size 0.
    """
    _, inverse = torch.unique(group_index, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    weight = (
        torch.ones(len(values), dtype=torch.float64)
        if sample_mask is None
        else sample_mask.bool().double()
    )
    values = values.double() * weight
    count = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, weight)
    total = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, values)
    mean = total / count.clamp(min=1)
    squares = torch.zeros(groups, dtype=torch.float64).index_add_(
        0, inverse, weight * (values - mean[inverse]) ** 2
    )
    std = torch.sqrt(squares / (count - 1).clamp(min=1))
    return mean[inverse], std[inverse], count[inverse]


def broadcast_valid_scores(scores: torch.Tensor, inputs: AdvantageInputs) -> AdvantageOutputs:
    """Per-response scores on their loss tokens; 0 for a masked sample (whose ``loss_mask``
    is 0 anyway: this holds when a caller passes a mask that still has its tokens)."""
    valid = inputs.valid()
    return broadcast_scores(torch.where(valid, scores, torch.zeros_like(scores)), inputs.loss_mask)


@ADVANTAGES.register("grpo")
def compute_grpo_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """GRPO: each response's reward minus its group's mean, over the group's std.

    ``norm_by_std=False`` keeps the mean-centred reward (Dr.GRPO), which does not up-weight
    groups whose rewards barely differ. A group whose rewards are all equal (or a group of
    one) gets advantage 0: it carries no signal about which response is better.
    """
    valid = inputs.valid()
    mean, std, _ = compute_group_stats(inputs.rewards, inputs.group_index, valid)
    centred = inputs.rewards.double() - mean
    scores = centred / (std + EPS) if inputs.config.norm_by_std else centred
    out = broadcast_valid_scores(scores, inputs)
    if valid.any():
        out.metrics["zero_std_frac"] = float((std[valid] == 0).float().mean())
    return out


def compute_passk_scores(
    correct: int, n: int, k: int, norm_by_std: bool = True
) -> tuple[float, float]:
    """Pass@k advantages of a correct and of a wrong response in a group of ``n`` with
    ``correct`` right answers (Chen et al., 2025, "Pass@k Training").

    Over the k-subsets of the group, a subset's reward is 1 when it holds a right answer:
    mean R = 1 - C(n - c, k) / C(n, k), std s = sqrt(R (1 - R)). A right response lifts every
    subset it is in to 1: A+ = (1 - R) / s. A wrong one is in a subset of reward 0 with
    probability C(n - c - 1, k - 1) / C(n - 1, k - 1): A- = (1 - R - that) / s. A group
    that is all right or all wrong has s = 0 and gets 0. ``norm_by_std=False`` leaves out the
    division by s (as ``grpo`` does for Dr.GRPO).
    """
    wrong = n - correct
    mean = 1 - comb(wrong, k) / comb(n, k)
    std = math.sqrt(mean * (1 - mean))
    if std == 0:
        return 0.0, 0.0
    all_wrong_given_wrong = comb(wrong - 1, k - 1) / comb(n - 1, k - 1) if wrong else 0.0
    scale = std if norm_by_std else 1.0
    return (1 - mean) / scale, (1 - mean - all_wrong_given_wrong) / scale


@ADVANTAGES.register("grpo_passk")
def compute_grpo_passk_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """GRPO for pass@k (``algorithm.pass_k``): advantages that reward a group for holding
    *some* right answer among k tries, which keeps exploring where pass@1 training sharpens.
    Rewards are read as binary: a response is right when its reward is above 0.5.

    Not veRL's ``grpo_passk``: veRL gives only the best response of each group an advantage,
    its reward minus the group's second best (over the group's std unless
    ``norm_adv_by_std_in_grpo=False``), and every other response 0. This is the closed-form
    pass@k advantage of Chen et al., 2025, which scores every response of the group."""
    k = inputs.config.pass_k
    right = inputs.rewards > 0.5
    valid = inputs.valid()
    scores = torch.zeros(len(inputs.rewards), dtype=torch.float64)
    for group in torch.unique(inputs.group_index):
        rows = inputs.group_index == group
        if int(rows.sum()) < k:
            raise ValueError(
                f"grpo_passk: a group of {int(rows.sum())} responses is smaller than "
                f"algorithm.pass_k={k}"
            )
        rows = rows & valid
        n = int(rows.sum())
        if n < k:  # masked samples left fewer than k: no k-subset to score
            continue
        positive, negative = compute_passk_scores(
            int(right[rows].sum()), n, k, inputs.config.norm_by_std
        )
        scores[rows] = torch.where(right[rows], positive, negative).double()
    return broadcast_valid_scores(scores, inputs)


@ADVANTAGES.register("rloo")
def compute_rloo_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """RLOO: each reward minus the mean of the *other* responses to the same prompt.

    Equals n/(n-1) times the mean-centred reward, n the group's samples that count (masked
    ones are no one's "other responses"); a group of one has no other responses and gets 0.
    """
    mean, _, count = compute_group_stats(inputs.rewards, inputs.group_index, inputs.valid())
    centred = inputs.rewards.double() - mean
    scores = torch.where(
        count > 1, centred * count / (count - 1).clamp(min=1), torch.zeros_like(centred)
    )
    return broadcast_valid_scores(scores, inputs)


@ADVANTAGES.register("reinforce_pp")
def compute_reinforce_pp_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE++: per-token returns discounted by ``gamma`` (KL penalty included), whitened
    over the batch."""
    mask = inputs.loss_mask.float() * inputs.valid().float().unsqueeze(1)
    returns = compute_reverse_cumsum(inputs.per_token_rewards(), mask, inputs.config.gamma)
    return AdvantageOutputs(whiten(returns, mask), returns)


@ADVANTAGES.register("reinforce_pp_baseline")
def compute_reinforce_pp_baseline_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE++-baseline: the group-mean reward is subtracted first, then as REINFORCE++."""
    valid = inputs.valid()
    mean, _, _ = compute_group_stats(inputs.rewards, inputs.group_index, valid)
    # A masked sample's loss mask is 0 already; ``valid`` keeps it out where a caller's isn't.
    mask = inputs.loss_mask.float() * valid.float().unsqueeze(1)
    token_rewards = inputs.per_token_rewards() - place_on_last_token(mean.float(), mask)
    returns = compute_reverse_cumsum(token_rewards, mask, inputs.config.gamma)
    return AdvantageOutputs(whiten(returns, mask), returns)


@ADVANTAGES.register("remax")
def compute_remax_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """ReMax: reward minus the reward of the greedy response to the same prompt."""
    if inputs.baseline is None:
        raise ValueError("remax needs the greedy baseline rewards (AdvantageInputs.baseline)")
    out = broadcast_valid_scores(inputs.rewards.double() - inputs.baseline.double(), inputs)
    valid = inputs.valid()
    if valid.any():
        out.metrics["baseline_mean"] = float(inputs.baseline[valid].double().mean())
    return out


@ADVANTAGES.register("gae")
def compute_gae_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """GAE(gamma, lambda) from per-token rewards and critic values, whitened over the batch.

    delta_t = r_t + gamma V_{t+1} - V_t (V after the last token is 0);
    A_t = delta_t + gamma lambda A_{t+1}; returns (the critic's targets) = A + V, unwhitened.

    Multi-turn: values and advantages live on ``loss_mask`` tokens only. An observation
    between two turns is skipped, as if absent: the last token of a turn bootstraps from the
    value of the next turn's first token, so the final reward reaches every turn.
    """
    if inputs.values is None:
        raise ValueError("gae needs critic values (AdvantageInputs.values); enable the critic")
    cfg = inputs.config
    mask = inputs.loss_mask.float() * inputs.valid().float().unsqueeze(1)
    rewards, values = inputs.per_token_rewards(), inputs.values.float() * mask
    batch, length = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_advantage, next_value = torch.zeros(batch), torch.zeros(batch)
    for t in reversed(range(length)):
        delta = rewards[:, t] + cfg.gamma * next_value - values[:, t]
        advantage = delta + cfg.gamma * cfg.lam * next_advantage
        advantages[:, t] = advantage * mask[:, t]
        # Unmasked tokens pass the later ones through: padding after a response carries the
        # initial zeros, an observation carries the next turn's value and advantage.
        real = mask[:, t] > 0
        next_advantage = torch.where(real, advantage, next_advantage)
        next_value = torch.where(real, values[:, t], next_value)
    returns = (advantages + values) * mask
    return AdvantageOutputs(whiten(advantages, mask), returns)
