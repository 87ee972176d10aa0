"""Batch: the one data structure that moves between the driver and the workers.

A Batch holds named tensors that share dim 0, non-tensor columns (numpy arrays of the
same length: strings, ground truths, python objects) and a ``meta`` dict for values that
describe the whole batch (the weights version, a temperature). Rows stay aligned across
every operation, which is what lets DP_SPLIT chunk a batch over ranks and glue the
results back together.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Self

import numpy as np
import torch

ROUTED_EXPERTS = "routed_experts"
"""The batch key of each token's routed experts (a mixture-of-experts rollout's routing, see
:mod:`rlframe.models.moe_routing`)."""

SAMPLE_MASK = "sample_mask"
"""The batch key of each row's sample mask, ``[rows]`` float: 1 for a sample that counts, 0
for one taken out of training (its reward or its env failed under ``reward.on_error=mask`` /
``agent.on_env_error=mask``; a filler row). A masked row also has ``loss_mask`` 0 and reward
0; it stays out of every statistic over samples (group means, stds, leave-one-out
baselines, reward metrics). A batch without the key counts every row."""


def read_sample_mask(batch: Batch) -> torch.Tensor:
    """The rows that count, as a bool ``[rows]`` tensor (all of them without
    :data:`SAMPLE_MASK`)."""
    if SAMPLE_MASK in batch.tensors:
        return batch.tensors[SAMPLE_MASK].bool()
    return torch.ones(len(batch), dtype=torch.bool)


def as_column(values: Sequence[Any] | np.ndarray) -> np.ndarray:
    """A 1-D numpy column. Python objects go in an object array so that rows never merge."""
    if isinstance(values, np.ndarray):
        return values
    column = np.empty(len(values), dtype=object)
    # One by one: a slice assignment would read equally long lists (chat turns) as a 2-D array.
    for i, value in enumerate(values):
        column[i] = value
    return column


class RowOps:
    """The row operations both wire types share (:class:`Batch`, and
    :class:`~rlframe.core.train_batch.TrainBatch`), written once over their ``rows`` and
    ``len``."""

    def __len__(self) -> int:
        raise NotImplementedError

    def rows(self, index: Any) -> Self:
        raise NotImplementedError

    def chunk(self, n: int) -> list[Self]:
        """Split into ``n`` consecutive parts; sizes differ by at most one, the larger first."""
        if n < 1:
            raise ValueError(f"chunk needs n >= 1, got {n}")
        base, extra = divmod(len(self), n)
        bounds = np.cumsum([0] + [base + (i < extra) for i in range(n)])
        return [self.rows(slice(int(a), int(b))) for a, b in pairwise(bounds)]

    def split(self, size: int) -> list[Self]:
        """Consecutive parts of ``size`` rows (the last may be shorter)."""
        if size < 1:
            raise ValueError(f"split needs size >= 1, got {size}")
        return [self.rows(slice(i, i + size)) for i in range(0, len(self), size)]

    def pad_to_multiple(self, k: int) -> tuple[Self, int]:
        """Append copies of the first rows until the length is a multiple of ``k``.

        Returns the padded rows and the number of rows added, which the caller strips
        from the results again.
        """
        pad = (-len(self)) % k
        if pad == 0:
            return self, 0
        if len(self) == 0:
            raise ValueError(f"cannot pad an empty {type(self).__name__}")
        index = np.concatenate([np.arange(len(self)), np.arange(pad) % len(self)])
        return self.rows(index), pad


class Batch(RowOps):
    """Row-aligned tensors and columns plus batch-level metadata.

    Read a tensor with ``batch.tensor(key)`` and a column with ``batch.column(key)``: each
    says in its type which kind it returns, and fails naming the key if the kind is wrong.

    Example:
        >>> b = Batch({"ids": torch.arange(6).view(3, 2)}, {"answer": ["1", "2", "3"]})
        >>> [len(c) for c in b.chunk(2)]
        [2, 1]
    """

    tensors: dict[str, torch.Tensor]
    columns: dict[str, np.ndarray]
    meta: dict[str, Any]

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        columns: Mapping[str, Sequence[Any] | np.ndarray] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.tensors = dict(tensors or {})
        # Columns arrive as lists from callers (texts, chat turns); rows are arrays from here on.
        self.columns = {k: as_column(v) for k, v in (columns or {}).items()}
        self.meta = dict(meta or {})
        sizes = {f"tensor {k!r}": v.shape[0] for k, v in self.tensors.items()}
        sizes |= {f"column {k!r}": len(v) for k, v in self.columns.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch rows disagree: {sizes}")

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.tensors.items()}
        return f"Batch(rows={len(self)}, tensors={shapes}, columns={list(self.columns)})"

    def __len__(self) -> int:
        for t in self.tensors.values():
            return t.shape[0]
        for c in self.columns.values():
            return len(c)
        return 0

    def keys(self) -> list[str]:
        return [*self.tensors, *self.columns]

    def __getitem__(self, key: str) -> torch.Tensor | np.ndarray:
        """A tensor or a column; code that knows which calls ``tensor`` or ``column``."""
        if key in self.tensors:
            return self.tensors[key]
        if key in self.columns:
            return self.columns[key]
        raise KeyError(f"Batch has no {key!r}; it has {self.keys()}")

    def tensor(self, key: str) -> torch.Tensor:
        """The tensor ``key``; TypeError if ``key`` is a column, KeyError if it is absent."""
        if key in self.tensors:
            return self.tensors[key]
        if key in self.columns:
            raise TypeError(f"Batch {key!r} is a column, not a tensor")
        raise KeyError(f"Batch has no tensor {key!r}; it has {self.keys()}")

    def column(self, key: str) -> np.ndarray:
        """The column ``key``; TypeError if ``key`` is a tensor, KeyError if it is absent."""
        if key in self.columns:
            return self.columns[key]
        if key in self.tensors:
            raise TypeError(f"Batch {key!r} is a tensor, not a column")
        raise KeyError(f"Batch has no column {key!r}; it has {self.keys()}")

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.columns

    def rows(self, index: slice | Sequence[int] | torch.Tensor | np.ndarray) -> Batch:
        """The rows at ``index`` (a slice or integer indices), with the same meta."""
        if isinstance(index, slice):
            tensors = {k: v[index] for k, v in self.tensors.items()}
            columns = {k: v[index] for k, v in self.columns.items()}
        else:
            idx = torch.as_tensor(np.asarray(index), dtype=torch.long)
            tensors = {k: v.index_select(0, idx) for k, v in self.tensors.items()}
            columns = {k: v[idx.numpy()] for k, v in self.columns.items()}
        return Batch(tensors, columns, dict(self.meta))

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all batches in order. Keys must match; meta comes from the first batch."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for b in batches[1:]:
            if set(b.keys()) != set(first.keys()):
                raise ValueError(
                    f"concat of batches with different keys: {first.keys()} vs {b.keys()}"
                )
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        columns = {k: np.concatenate([b.columns[k] for b in batches]) for k in first.columns}
        return Batch(tensors, columns, dict(first.meta))

    def repeat(self, n: int) -> Batch:
        """Each row ``n`` times in a row (interleaved: a a b b), as GRPO groups need."""
        index = np.repeat(np.arange(len(self)), n)
        return self.rows(index)

    def select(self, keys: Iterable[str]) -> Batch:
        """Only the named tensors and columns (meta is kept)."""
        keys = list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch has no {missing}; it has {self.keys()}")
        return Batch(
            {k: v for k, v in self.tensors.items() if k in keys},
            {k: v for k, v in self.columns.items() if k in keys},
            dict(self.meta),
        )

    def union(self, other: Batch) -> Batch:
        """Keys of both batches, which must have the same rows. Shared keys must be equal."""
        if len(self) != len(other) and self.keys() and other.keys():
            raise ValueError(f"union of batches with {len(self)} and {len(other)} rows")
        for k in set(self.tensors) & set(other.tensors):
            if not torch.equal(self.tensors[k], other.tensors[k]):
                raise ValueError(f"union: tensor {k!r} differs between the batches")
        for k in set(self.columns) & set(other.columns):
            if not np.array_equal(self.columns[k], other.columns[k]):
                raise ValueError(f"union: column {k!r} differs between the batches")
        return Batch(
            self.tensors | other.tensors, self.columns | other.columns, self.meta | other.meta
        )

    def with_tensors(self, **tensors: torch.Tensor) -> Batch:
        """A new batch with these tensors added or replaced."""
        return Batch(self.tensors | tensors, dict(self.columns), dict(self.meta))


@dataclass
class UpdateResult:
    """What one rank's policy update returns to the driver."""

    metrics: dict[str, float]
    """``actor/*`` means over the update's micro-batches on this rank."""
    own_logprobs: torch.Tensor | None = None
    """An exactly on-policy update's own detached log-probs of this rank's rows ([rows, R],
    in the order the rank got them): the batch's ``old_logprobs``. None when the batch
    brought old log-probs (or the rollout's are the old policy)."""
