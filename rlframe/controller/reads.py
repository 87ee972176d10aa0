"""The Batch keys each rollout-side worker method reads: all that crosses the wire to it.

A worker method declares them with ``@dispatch(mode, reads=...)`` and the worker group
sends ``batch.select`` of the ones present, so the text columns (``prompt``, ``response``,
``messages``, ``extra``, ``ground_truth``) and the tensors a method never looks at stay on
the driver. Optional keys are listed too: a key that switches a path on the worker
(``max_tokens`` for a multi-turn budget) goes when the driver's Batch has it. Meta always
goes. The training methods take a typed :class:`~rlframe.core.train_batch.TrainBatch`
instead, declared by a :class:`~rlframe.core.train_batch.TrainReads`.
"""

from __future__ import annotations

IMAGES = "images"
"""A vision-language row's images (a list of encoded images per row; optional): the
rollout engine reads them, and the trainer's forward as ``TrainBatch.images``."""

GENERATE = ("prompt_tokens", "seed", "max_tokens", IMAGES)
"""A rollout: each row's context (a list of ids), sampling seed, (optional) token cap and
(optional) images."""

REWARD_MODEL = ("messages", "response")
"""Reward-model scoring: the chat turns and the response text it renders."""
