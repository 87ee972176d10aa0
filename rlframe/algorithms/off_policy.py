"""Which log-probs count as the old policy, and the decoupled-PPO behaviour weight.

``algorithm.off_policy_correction`` picks the old policy of the update's ratio:

- ``recompute``: the trainer's forward pass over the batch with the weights before the update
  (skipped when the update is one optimizer step and runs without dropout: its own detached
  log-probs are those numbers, taken with the same weights, whether the batch is fresh or
  ``rollout.max_staleness`` versions old). The rollout gap is left to ``tis_cap`` /
  ``mismatch_mask``.
- ``rollout``: the rollout engine's own log-probs; no forward pass ever.
- ``decoupled`` (AReaL's decoupled PPO): the ratio, and so the clip, is taken against the
  recomputed *proximal* policy (as ``recompute``), and every token's loss is multiplied by the
  behaviour weight w = pi_prox / pi_behav, pi_behav being the rollout engine's log-probs.
  Tokens with w above ``algorithm.behav_weight_cap`` are dropped (weight 0), as AReaL does:
  a token that stale carries more variance than signal. The loss is still normalised by all
  loss tokens. The weight is a constant (no gradient).

:func:`pick_old_logprobs` is the one rule of which log-probs are old (:class:`OldLogprobs`):
the driver asks it through :func:`plan_old_logprobs` before a step's update, the training
role and the policy objective ask it of the batch they were given.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

import torch

from rlframe.algorithms.losses import MAX_LOG_RATIO
from rlframe.core.names import OffPolicyCorrection

if TYPE_CHECKING:
    from rlframe.config import AlgorithmConfig, Config


class OldLogprobs(Enum):
    """Where an update's old log-probs (the old policy of its ratio) come from."""

    rollout = "rollout"
    """The rollout engine's own (``off_policy_correction=rollout``); no forward pass."""
    recomputed = "recomputed"
    """The trainer's old-log-prob pass with the weights before the update (``recompute``, and
    ``decoupled``'s proximal policy)."""
    update = "update"
    """The update's own log-probs, detached: an update of one optimizer step skips the pass
    (the same numbers: its forward runs with the weights the pass would have used)."""


def pick_old_logprobs(correction: OffPolicyCorrection, recomputed: bool) -> OldLogprobs:
    """Which log-probs are old: the rollout's under the ``rollout`` correction, else the
    trainer's old-log-prob pass where it runs (``recomputed``: on the driver, whether the pass
    must run; on a worker, whether its batch carries the pass's ``old_logprobs``), else the
    update's own."""
    if correction is OffPolicyCorrection.rollout:
        return OldLogprobs.rollout
    return OldLogprobs.recomputed if recomputed else OldLogprobs.update


def update_has_dropout(cfg: Config) -> bool:
    """The update's forward pass runs with dropout on (``model.lora.dropout > 0``): its own
    log-probs are one dropout mask's, not the policy's that sampled the tokens, so they can
    neither be the old policy nor be compared with the rollout's (the sync check would read
    the dropout noise as a broken weight sync). The old-log-prob pass runs in eval mode."""
    return cfg.model.lora.enabled and cfg.model.lora.dropout > 0


def plan_old_logprobs(
    cfg: Config, rows: int, kl_in_reward: bool, actor_updates: bool
) -> OldLogprobs:
    """The driver's :func:`pick_old_logprobs` for a step of ``rows`` responses. The pass runs
    when ``algorithm.recompute_old_logprobs`` asks for it or the update makes more than one
    optimizer step (:meth:`~rlframe.config.ActorConfig.updates_in_one_pass`); when the update
    runs with dropout (:func:`update_has_dropout`); also when the in-reward KL reads the old
    log-probs before the update, and when a step without an actor update (the actor waits for
    the critic) has no update to take them from.

    Staleness does not call for the pass: the old policy of ``recompute`` (and ``decoupled``'s
    proximal policy) is the trainer's weights before the update, not the weights that sampled
    the tokens, and nothing changes the trainer's weights between the pass and the update's
    first forward. An asynchronous step (``rollout.max_staleness`` >= 1) of one optimizer step
    takes the update's own log-probs as a lockstep one does."""
    recomputed = (
        cfg.algorithm.recompute_old_logprobs
        or not cfg.actor.updates_in_one_pass(rows)
        or update_has_dropout(cfg)
        or kl_in_reward
        or not actor_updates
    )
    return pick_old_logprobs(cfg.algorithm.off_policy_correction, recomputed)


def needs_old_logprob_pass(cfg: Config, rows: int, kl_in_reward: bool, actor_updates: bool) -> bool:
    """The trainer's old-log-prob forward pass runs (:func:`plan_old_logprobs`): not when the
    rollout's log-probs are the old policy, nor when the update is one optimizer step and takes
    its own."""
    return plan_old_logprobs(cfg, rows, kl_in_reward, actor_updates) is OldLogprobs.recomputed


def compute_behaviour_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
) -> torch.Tensor:
    """[B, T] decoupled-PPO weights pi_prox / pi_behav on loss tokens, 0 where above ``cap``
    (0: no cap) and off the mask; detached."""
    mask = mask.to(proximal_logprobs.dtype)
    log_weight = (proximal_logprobs.detach() - behaviour_logprobs).clamp(
        -MAX_LOG_RATIO, MAX_LOG_RATIO
    )
    weights = torch.exp(log_weight) * mask
    if cap > 0:
        weights = torch.where(weights > cap, torch.zeros_like(weights), weights)
    return weights


def compute_off_policy_metrics(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmConfig,
) -> dict[str, float]:
    """Whole-batch ``off_policy/behav_weight_*`` metrics of the decoupled correction (none for
    the other modes): the weight's mean and max over loss tokens before the cap, and the share
    of loss tokens the cap drops."""
    if cfg.off_policy_correction is not OffPolicyCorrection.decoupled:
        return {}
    mask = mask.to(proximal_logprobs.dtype)
    on = mask.bool()
    if not on.any():
        return {}
    raw = compute_behaviour_weights(proximal_logprobs, behaviour_logprobs, mask, cap=0.0)
    count = mask.sum()
    capped = (raw > cfg.behav_weight_cap) & on if cfg.behav_weight_cap > 0 else torch.zeros_like(on)
    return {
        "off_policy/behav_weight_mean": float(raw[on].sum() / count),
        "off_policy/behav_weight_max": float(raw[on].max()),
        "off_policy/behav_capped_frac": float(capped.to(mask.dtype).sum() / count),
    }
