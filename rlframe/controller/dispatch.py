"""How one driver call fans out to the ranks of a worker group and how results come back.

A worker method declares its mode once with ``@dispatch(Dispatch.X)``; the worker group
then exposes it on the driver as a plain function. Four modes are enough:

- ``ONE_TO_ALL``: every rank gets the same arguments; the result is the list of the ranks'
  results (rank order).
- ``DP_SPLIT``: every :class:`Batch` (or :class:`TrainBatch`) argument is padded to a
  multiple of the world size and chunked, one chunk per rank; other arguments go to every
  rank as they are. A Batch result
  must have one row per input row; the ranks' results are concatenated and the padding
  rows stripped. Other results come back as a list.
- ``ROLLOUT_DP_SPLIT``: ``DP_SPLIT`` over the rollout's data-parallel groups. With rollout
  tensor parallelism TP, ranks ``[g*TP, (g+1)*TP)`` hold one engine: the Batch is split into
  ``world / TP`` chunks, every rank of group ``g`` gets chunk ``g`` (same rows, same seeds),
  and the result of each group's first rank is collected. With TP = 1 it is ``DP_SPLIT``.
- ``RANK_ZERO``: only rank 0 runs the method; its result is returned.

A method may also declare what it reads of a Batch argument. Keys, ``@dispatch(
Dispatch.DP_SPLIT, reads=("prompt_tokens", ...))``: the group then sends only those tensors
and columns (the ones present; meta always goes), so text columns and tensors the method
never looks at stay on the driver. A training method declares a
:class:`~rlframe.core.train_batch.TrainReads` (``reads=POLICY_UPDATE``): the group sends it
the typed :class:`~rlframe.core.train_batch.TrainBatch` of those fields, built on the driver.
Without ``reads`` the whole Batch is sent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

from rlframe.core.protocol import Batch
from rlframe.core.train_batch import TrainBatch, TrainReads

DISPATCH_ATTR = "__rlframe_dispatch__"

F = TypeVar("F", bound=Callable[..., Any])


class Dispatch(Enum):
    ONE_TO_ALL = "one_to_all"
    DP_SPLIT = "dp_split"
    ROLLOUT_DP_SPLIT = "rollout_dp_split"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class MethodSpec:
    """How the driver calls one worker method."""

    mode: Dispatch
    reads: tuple[str, ...] | TrainReads | None = None
    """Batch keys the method reads (optional ones included), or the TrainBatch fields of a
    training method; None sends whole Batches."""


Reads = tuple[str, ...] | TrainReads | None
"""What a method reads of its Batch arguments (see :class:`MethodSpec`)."""


def dispatch(mode: Dispatch, reads: Reads = None) -> Callable[[F], F]:
    """Mark a worker method as callable from the driver with the given dispatch mode;
    ``reads`` names the Batch keys it reads, the only ones the group sends it, or the
    TrainBatch it takes instead."""
    spec = MethodSpec(mode, tuple(reads) if isinstance(reads, tuple) else reads)

    def mark(fn: F) -> F:
        setattr(fn, DISPATCH_ATTR, spec)
        return fn

    return mark


def find_dispatch_methods(worker_cls: type) -> dict[str, MethodSpec]:
    """Names and specs of every ``@dispatch``-marked method of a worker class."""
    methods = {}
    for name in dir(worker_cls):
        spec = getattr(getattr(worker_cls, name, None), DISPATCH_ATTR, None)
        if spec is not None:
            methods[name] = spec
    return methods


def select_reads(
    method: str, reads: Reads, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Every Batch argument cut down to the keys in ``reads`` that it has (meta kept), or
    made the TrainBatch that ``reads`` declares."""
    if reads is None:
        return args, kwargs

    def cut(value: Any) -> Any:
        if not isinstance(value, Batch):
            return value
        if isinstance(reads, TrainReads):
            return reads.build(value)
        keys = [k for k in reads if k in value]
        if len(value) and not keys:
            # A Batch without keys has no rows: DP_SPLIT could not split it.
            raise ValueError(
                f"{method}() reads {list(reads)} but its Batch has none of them: {value.keys()}"
            )
        return value.select(keys)

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


@dataclass
class RankCall:
    """The arguments for one rank's call."""

    rank: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class FanOut:
    """Per-rank calls plus what the collect step needs to undo the split."""

    calls: list[RankCall]
    padding: int = 0
    chunk_rows: int = 0
    group_size: int = 1
    """Ranks that got the same chunk (the rollout TP size); one result per group is kept."""


def split_call(
    mode: Dispatch, world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any], tp_size: int = 1
) -> FanOut:
    """Turn one driver call into per-rank calls according to ``mode``; ``tp_size`` is the
    rollout tensor-parallel size that ``ROLLOUT_DP_SPLIT`` groups ranks by."""
    if mode is Dispatch.RANK_ZERO:
        return FanOut([RankCall(0, args, kwargs)])
    if mode is Dispatch.ONE_TO_ALL:
        return FanOut([RankCall(r, args, kwargs) for r in range(world_size)])
    group = tp_size if mode is Dispatch.ROLLOUT_DP_SPLIT else 1
    if world_size % group:
        raise ValueError(
            f"world size {world_size} is not a multiple of the tensor-parallel size {group}"
        )
    fan_out = split_batches(world_size // group, args, kwargs)
    # Rank r belongs to group r // TP and gets that group's chunk.
    calls = [
        RankCall(r, fan_out.calls[r // group].args, fan_out.calls[r // group].kwargs)
        for r in range(world_size)
    ]
    return FanOut(calls, fan_out.padding, fan_out.chunk_rows, group)


def split_batches(parts: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> FanOut:
    """Pad every Batch (and TrainBatch) argument to a multiple of ``parts`` and chunk it: one
    call per part, other arguments repeated as they are."""
    batches = [a for a in (*args, *kwargs.values()) if isinstance(a, Batch | TrainBatch)]
    if not batches:
        raise TypeError("a DP_SPLIT method needs at least one Batch or TrainBatch argument")
    sizes = {len(b) for b in batches}
    if len(sizes) > 1:
        raise ValueError(f"DP_SPLIT Batch arguments have different lengths: {sorted(sizes)}")
    rows = sizes.pop()
    padding = (-rows) % parts

    def chunks(value: Any) -> list[Any]:
        if isinstance(value, Batch | TrainBatch):
            padded, _ = value.pad_to_multiple(parts)
            return padded.chunk(parts)
        return [value] * parts

    split_args = [chunks(a) for a in args]
    split_kwargs = {k: chunks(v) for k, v in kwargs.items()}
    calls = [
        RankCall(p, tuple(a[p] for a in split_args), {k: v[p] for k, v in split_kwargs.items()})
        for p in range(parts)
    ]
    return FanOut(calls, padding, (rows + padding) // parts)


def collect_results(mode: Dispatch, fan_out: FanOut, results: list[Any]) -> Any:
    """Combine the ranks' results (in rank order) into what the driver call returns."""
    if mode is Dispatch.RANK_ZERO:
        return results[0]
    if mode is Dispatch.ONE_TO_ALL:
        return results
    # The other ranks of a TP group computed the same rows.
    results = results[:: fan_out.group_size]
    if not all(isinstance(r, Batch) for r in results):
        return results
    for index, result in enumerate(results):
        if len(result) != fan_out.chunk_rows:
            raise ValueError(
                f"rank {index * fan_out.group_size} returned {len(result)} rows for "
                f"{fan_out.chunk_rows} input rows; a DP_SPLIT method must return one row per "
                "input row"
            )
    merged = Batch.concat(results)
    if fan_out.padding:
        merged = merged.rows(slice(0, len(merged) - fan_out.padding))
    return merged
