"""The Batch keys each standard worker method reads: all that crosses the wire to it.

A worker method declares them with ``@dispatch(mode, reads=...)`` and the worker group
sends ``batch.select`` of the ones present, so the text columns (``prompt``, ``response``,
``messages``, ``extra``, ``ground_truth``) and the tensors a method never looks at stay on
the driver. Optional keys are listed too: a key that switches a path on the worker
(``old_logprobs`` for an off-policy update, ``max_tokens`` for a multi-turn budget) goes
when the driver's Batch has it. Meta always goes.
"""

from __future__ import annotations

IMAGES = "images"
"""A vision-language row's images (a list of encoded images per row; optional): the
rollout engine and the trainer's forward both read them."""

GENERATE = ("prompt_tokens", "seed", "max_tokens", IMAGES)
"""A rollout: each row's context (a list of ids), sampling seed, (optional) token cap and
(optional) images."""

FORWARD = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "loss_mask", IMAGES)
"""A training-engine forward over prompt + response (see rlframe.core.sequence_layout)."""

POLICY_FORWARD = (*FORWARD, "routed_experts")
"""The policy's forward: with router replay on, each token's routed experts
(rlframe.models.moe_routing) too. The reference and the critic route freely: not theirs."""

POLICY_UPDATE = (
    *POLICY_FORWARD,
    "advantages",
    "old_logprobs",
    "rollout_logprobs",
    "ref_logprobs",
    "teacher_logprobs",
    "teacher_top_ids",
    "teacher_top_logprobs",
)
"""A policy update: the policy forward's keys, the advantages, and the log-probs the loss,
the mismatch and off-policy corrections, the KL term and a distillation loss term read
(each optional)."""

VALUE_UPDATE = (*FORWARD, "values", "returns")
"""A critic update: the forward's keys, the old values and the returns."""

REWARD_MODEL = ("messages", "response")
"""Reward-model scoring: the chat turns and the response text it renders."""
