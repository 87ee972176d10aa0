"""Names of the built-in algorithm pieces that the config schema validates against.

This module imports nothing: the schema (``rlframe/config/``) reads these tables while
validating, and the tensor code of ``rlframe/algorithms/`` reads them too, so neither depends
on the other (and the training side, ``bench/gpu_check.py`` included, imports them without the
config package and its omegaconf). Registered *functions* are looked up later, by
``rlframe.run.preflight``, before Ray starts.
"""

from __future__ import annotations

from enum import Enum

LOSS_AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
)
"""How per-token losses reduce to one number (see ``losses.aggregate_loss``)."""

KL_ESTIMATORS = ("k1", "abs", "k2", "k3", "k1+", "abs+", "k3+")
"""Per-token KL estimators; ``+``: the value of k1/abs/k3 with the gradient of k2. The first
four (no ``+``) are the ones the in-reward penalty takes (no gradient flows through it)."""

MISMATCH_LEVELS = ("token", "sequence")
"""Granularity of the rollout/trainer mismatch corrections (TIS, masked IS)."""


class OffPolicyCorrection(str, Enum):
    """Which log-probs are the update's old policy (see ``rlframe.algorithms.off_policy``)."""

    recompute = "recompute"
    """The trainer's forward pass with the weights before the update."""
    rollout = "rollout"
    """The rollout engine's own log-probs; no forward pass."""
    decoupled = "decoupled"
    """AReaL's decoupled PPO: the recomputed proximal policy, tokens weighted by
    pi_prox / pi_rollout."""


OFF_POLICY_CORRECTIONS = tuple(c.value for c in OffPolicyCorrection)


class RouterReplay(str, Enum):
    """Where the trainer's mixture-of-experts routing comes from (see
    ``rlframe.models.moe_routing``)."""

    off = "off"
    """The trainer's own routers choose the experts of every token."""
    rollout = "rollout"
    """R3: every token goes to the experts the rollout engine routed it to."""


ROUTER_REPLAYS = tuple(r.value for r in RouterReplay)

NEEDS_CRITIC = frozenset({"gae"})
"""Advantage estimators that need critic values."""

NEEDS_GREEDY_BASELINE = frozenset({"remax"})
"""Advantage estimators that need the reward of a greedy response per prompt."""

GROUP_RELATIVE = frozenset({"grpo", "rloo", "reinforce_pp_baseline", "grpo_passk"})
"""Advantage estimators that compare responses to the same prompt: with one response per
prompt (``rollout.n=1``) every advantage is 0 and nothing is learned."""

TASK_NAMES = ("arithmetic", "copy", "reverse", "count", "mixed", "guess", "colour")
"""The synthetic tasks ``data.task`` names (:mod:`rlframe.data.tasks` generates them; a test
keeps the two lists equal)."""
