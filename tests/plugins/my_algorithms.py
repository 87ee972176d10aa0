"""A user's own advantage estimator and policy loss, as docs/algorithms.md shows them.

Load them with ``algorithm.advantage=tests/plugins/my_algorithms.py:compute_sign_advantages``
and ``algorithm.policy_loss=tests/plugins/my_algorithms.py:compute_reinforce_loss``.
"""

from __future__ import annotations

import torch

from rlframe.algorithms.advantages import AdvantageInputs, AdvantageOutputs, compute_group_stats
from rlframe.algorithms.losses import PolicyLossInputs, PolicyLossOutputs


def compute_sign_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """+1 for responses above their group's mean reward, -1 below, 0 at it. Masked samples
    (``inputs.sample_mask`` 0) stay out of the mean; their loss mask is 0, so their
    advantages are too."""
    mean, _, _ = compute_group_stats(inputs.rewards, inputs.group_index, inputs.sample_mask)
    sign = torch.sign(inputs.rewards.double() - mean).float()
    advantages = sign.unsqueeze(1) * inputs.loss_mask.float()
    return AdvantageOutputs(
        advantages, advantages.clone(), {"positive_frac": float((sign > 0).float().mean())}
    )


def compute_reinforce_loss(inputs: PolicyLossInputs) -> PolicyLossOutputs:
    """Plain REINFORCE: -A * log p, ignoring the old policy. Per-token metrics are averaged
    over the loss tokens and logged as ``actor/<name>``."""
    return PolicyLossOutputs(
        -inputs.advantages * inputs.logprobs, {"logprob": inputs.logprobs.detach()}
    )
