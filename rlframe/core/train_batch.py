"""TrainBatch: the typed rows a training worker receives (the trainer's side of the wire).

The driver holds a step's data as a :class:`~rlframe.core.protocol.Batch`, keyed by
strings. A training method declares what it reads with a :class:`TrainReads` (``@dispatch(
Dispatch.DP_SPLIT, reads=POLICY_UPDATE)``), and the worker group sends it
``reads.build(batch)``: a :class:`TrainBatch` with the five grids every forward needs and
the optional fields that method reads, the ones the step's Batch has. A worker then reads
``batch.advantages``, never ``batch.tensor("advantages")``, and an absent optional field
is ``None``, never a missing key.

``P`` below is the (left-padded) prompt width and ``R`` the (right-padded) response width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Self, TypeVar

import numpy as np
import torch

from rlframe.core.protocol import Batch, RowOps

T = TypeVar("T")

RowIndex = slice | Sequence[int] | torch.Tensor | np.ndarray
"""Rows to take: a slice or integer indices."""


@dataclass
class TrainBatch(RowOps):
    """Rows of prompt + response grids and what the loss reads of them, row-aligned.

    Every field that is not None has one entry per row; the row operations (:meth:`rows`,
    :meth:`chunk`, :meth:`split`, :meth:`concat`, :meth:`pad_to_multiple`) keep them aligned
    and leave None fields None.
    """

    prompt_ids: torch.Tensor
    """[rows, P] long: prompt token ids, left-padded."""
    prompt_mask: torch.Tensor
    """[rows, P] 1 on real prompt tokens, 0 on padding."""
    response_ids: torch.Tensor
    """[rows, R] long: response token ids, right-padded."""
    response_mask: torch.Tensor
    """[rows, R] 1 on response tokens that exist (and are attended to)."""
    loss_mask: torch.Tensor
    """[rows, R] 1 on the response tokens the policy sampled (0 on a tool observation
    inside a response, on padding and on a masked sample's tokens)."""
    advantages: torch.Tensor | None = None
    """[rows, R] per-token advantages (a policy update)."""
    old_logprobs: torch.Tensor | None = None
    """[rows, R] the old policy's log-probs; None: an exactly on-policy update takes its
    own (see :func:`rlframe.algorithms.off_policy.pick_old_logprobs`)."""
    rollout_logprobs: torch.Tensor | None = None
    """[rows, R] the rollout engine's log-probs of the sampled tokens."""
    ref_logprobs: torch.Tensor | None = None
    """[rows, R] the reference policy's log-probs (the loss's KL term)."""
    teacher_logprobs: torch.Tensor | None = None
    """[rows, R] a distillation teacher's log-probs of the sampled tokens."""
    teacher_top_ids: torch.Tensor | None = None
    """[rows, R, k] long: the teacher's top-k token ids at each response position."""
    teacher_top_logprobs: torch.Tensor | None = None
    """[rows, R, k] the teacher's log-probs of those ids."""
    values: torch.Tensor | None = None
    """[rows, R] the critic's values before the update (its clipped loss's anchor)."""
    returns: torch.Tensor | None = None
    """[rows, R] the critic's regression targets."""
    routed_experts: torch.Tensor | None = None
    """[rows, P + R, MoE layers, top_k] int16: the experts the rollout routed each token to
    (-1 where none), for router replay (:mod:`rlframe.models.moe_routing`)."""
    images: list[list[bytes]] | None = None
    """A vision-language row's images, encoded (a list per row, empty for a row without)."""
    row_index: torch.Tensor | None = None
    """[rows] long: each row's place in the batch a worker split into micro-batches, where
    it scatters the micro-batches' outputs back (set on the worker, never sent)."""

    def __post_init__(self) -> None:
        absent = [f.name for f in fields(self) if f.default is dataclasses.MISSING]
        absent = [name for name in absent if getattr(self, name) is None]
        if absent:
            raise ValueError(f"TrainBatch needs {absent}; they are None")
        sizes = {f.name: len(v) for f, v in self.present()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"TrainBatch rows disagree: {sizes}")

    def present(self) -> list[tuple[dataclasses.Field[Any], Any]]:
        """The fields that are not None, with their values."""
        found = [(f, getattr(self, f.name)) for f in fields(self)]
        return [(f, v) for f, v in found if v is not None]

    def __len__(self) -> int:
        return int(self.prompt_ids.shape[0])

    def rows(self, index: RowIndex) -> Self:
        """The rows at ``index``, every field alike (a slice of a tensor is a view of it)."""
        if isinstance(index, slice):
            taken: dict[str, Any] = {f.name: v[index] for f, v in self.present()}
        else:
            at = torch.as_tensor(np.asarray(index), dtype=torch.long).reshape(-1)
            taken = {f.name: take(v, at) for f, v in self.present()}
        return dataclasses.replace(self, **taken)

    @classmethod
    def concat(cls, parts: Sequence[Self]) -> Self:
        """Rows of all parts in order. A field must be None in every part or in none."""
        if not parts:
            raise ValueError("concat needs at least one TrainBatch")
        values: dict[str, Any] = {}
        for f in fields(cls):
            column = [getattr(p, f.name) for p in parts]
            if all(v is None for v in column):
                continue
            if any(v is None for v in column):
                raise ValueError(f"concat of TrainBatches where only some have {f.name}")
            values[f.name] = (
                torch.cat(column) if isinstance(column[0], torch.Tensor) else sum(column, [])
            )
        return cls(**values)


def take(value: torch.Tensor | list[Any], at: torch.Tensor) -> torch.Tensor | list[Any]:
    """The entries of one field at the row indices ``at``."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, at)
    return [value[i] for i in at.tolist()]


def need(value: T | None, name: str) -> T:
    """``value``, which the pass at hand cannot do without; ValueError naming the field
    when the driver sent none."""
    if value is None:
        raise ValueError(f"this pass reads TrainBatch.{name}, and the batch has none")
    return value


REQUIRED = tuple(f.name for f in fields(TrainBatch) if f.default is dataclasses.MISSING)
"""The fields every TrainBatch has: the prompt and response grids and the loss mask."""

OPTIONAL = tuple(f.name for f in fields(TrainBatch) if f.name not in REQUIRED)
"""The fields a training method may read, each present when the step has it."""


@dataclass(frozen=True)
class TrainReads:
    """What a training method reads of the driver's Batch: the :data:`REQUIRED` fields and
    the ``optional`` ones the Batch has (a field that switches a path on the worker, like
    ``old_logprobs``, goes when the step computed it)."""

    optional: tuple[str, ...] = ()
    """Names of :data:`OPTIONAL` fields."""

    def __post_init__(self) -> None:
        unknown = [name for name in self.optional if name not in OPTIONAL]
        if unknown:
            raise ValueError(f"TrainBatch has no optional field {unknown}; it has {OPTIONAL}")

    def build(self, batch: Batch) -> TrainBatch:
        """The rows of ``batch`` as a TrainBatch of these fields; KeyError naming a required
        grid the Batch lacks."""
        values: dict[str, Any] = {name: batch.tensor(name) for name in REQUIRED}
        for name in self.optional:
            if name not in batch:
                continue
            if name == "images":
                values[name] = [list(row or []) for row in batch.column(name)]
            else:
                values[name] = batch.tensor(name)
        return TrainBatch(**values)


FORWARD = TrainReads(("images",))
"""A training engine's forward over prompt + response (the reference's, the critic's; see
:mod:`rlframe.core.sequence_layout`): the grids and a vision-language row's images."""

POLICY_FORWARD = TrainReads((*FORWARD.optional, "routed_experts"))
"""The policy's forward: with router replay on, each token's routed experts too. The
reference and the critic route freely: not theirs."""

POLICY_UPDATE = TrainReads(
    (
        *POLICY_FORWARD.optional,
        "advantages",
        "old_logprobs",
        "rollout_logprobs",
        "ref_logprobs",
        "teacher_logprobs",
        "teacher_top_ids",
        "teacher_top_logprobs",
    )
)
"""A policy update: the policy forward's fields, the advantages, and the log-probs the
loss, the mismatch and off-policy corrections, the KL term and a distillation term read."""

VALUE_UPDATE = TrainReads((*FORWARD.optional, "values", "returns"))
"""A critic update: the forward's fields, the old values and the returns."""
