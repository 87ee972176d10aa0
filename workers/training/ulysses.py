"""Ulysses sequence parallelism: the ranks of a sequence-parallel group share one forward.

Each rank of the group holds a contiguous slice of the micro-batch's sequence (padded or
packed), with the global position ids of its slice. Everything outside attention is
per-token and runs on the slice alone. Around attention an all-to-all trades the sequence
slice for a slice of the heads (every rank then sees the whole sequence for ``heads / size``
heads), the kernel runs, and a second all-to-all trades back. Activation memory per rank
falls with the group size; the weights stay FSDP-sharded over all ranks as before.

The exchange is an attention function registered with transformers' ``AttentionInterface``
(``ulysses_sdpa``, ``ulysses_flash_attention_2``) that wraps the plain kernel: no model code
is edited. A forward that passes no :class:`SequenceShard` (the weight-sync probe) runs the
plain kernel unchanged.

Each rank computes log-probs (or values) only for the selected tokens whose predicting
position lies in its slice; :class:`GatherTokens` assembles the group's [N] values on every
rank, so the loss code sees the whole micro-batch, and its backward hands each rank back
the gradient of its own tokens only: summed over the group, every token counts once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from rlframe.core.sequence_layout import SequenceLayout

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from rlframe.core.train_batch import TrainBatch

ULYSSES_PREFIX = "ulysses_"


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group: ranks ``dp * size .. dp * size + size - 1`` of the
    default group (a data x sequence mesh), and the kernel that runs inside the exchange."""

    group: ProcessGroup
    rank: int
    """This rank's place in the group (which slice of every sequence it holds)."""
    size: int
    kernel: str
    """``sdpa`` or ``flash_attention_2``."""


@cache
def build_mesh_groups(device: str, size: int) -> ProcessGroup:
    """The sequence-parallel group of this rank in a (data, sequence) mesh over the default
    group; built once per process (creating groups is a collective of all ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh(device, (world // size, size), mesh_dim_names=("dp", "sp"))
    return mesh.get_group("sp")


def build_sequence_parallel(size: int, device: str, kernel: str) -> SequenceParallel | None:
    """The group for ``*.sequence_parallel_size = size`` (None for 1: nothing to share)."""
    if size <= 1:
        return None
    world = dist.get_world_size()
    if world % size:
        raise ValueError(f"sequence_parallel_size {size} must divide the {world} ranks")
    group = build_mesh_groups(device, size)
    return SequenceParallel(group, dist.get_rank(group), size, kernel)


def exchange(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup
) -> torch.Tensor:
    """All-to-all: cut ``x`` in ``size`` parts along ``scatter_dim``, send part j to rank j,
    and join the parts received (in rank order) along ``gather_dim``."""
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class Exchange(torch.autograd.Function):
    """:func:`exchange` with its inverse (the same all-to-all, dimensions swapped) as backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup
    ) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return exchange(grad, gather_dim, scatter_dim, ctx.group), None, None, None


@dataclass
class SequenceShard:
    """What the attention function needs beyond q, k, v: passed through the model's forward
    as the ``sequence_shard`` keyword (transformers hands extra keywords to attention)."""

    sp: SequenceParallel
    kernel_kwargs: dict[str, Any] = field(default_factory=dict)
    """flash only: the whole sequence's ``cu_seq_lens_*`` / ``max_length_*`` (packed) or
    its [b, L] padding mask (``attention_mask``), computed once per forward."""


class AttentionLayer(Protocol):
    """What the wrapper reads of a transformers attention layer (any architecture's)."""

    config: PreTrainedConfig
    num_key_value_groups: int


class ModuleView:
    """The attention module as the wrapped kernel sees it after the exchange: its own
    number of query heads per key/value head, and the kernel's name in its config."""

    def __init__(self, module: AttentionLayer, groups: int, config: ConfigView) -> None:
        self.__dict__.update(module=module, num_key_value_groups=groups, config=config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["module"], name)


class ConfigView:
    """A model config that names ``kernel`` as its attention implementation."""

    def __init__(self, config: PreTrainedConfig, kernel: str) -> None:
        self.__dict__.update(config=config, _attn_implementation=kernel)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["config"], name)


def repeat_kv_heads(x: torch.Tensor, size: int) -> torch.Tensor:
    """Key/value heads repeated (each next to itself) until the group size divides them:
    query head j reads key/value head j // (heads / kv_heads) before and after."""
    repeats = size // math.gcd(x.shape[1], size)
    return x.repeat_interleave(repeats, dim=1) if repeats > 1 else x


def ulysses_attention_forward(
    module: AttentionLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    sequence_shard: SequenceShard | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention over the whole sequence for this rank's heads. q, k, v arrive [b, heads,
    L / size, d] (this rank's slice, rotary already applied at global positions); the output
    leaves [b, L / size, heads, d], as a plain kernel's would for the slice."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = module.config._attn_implementation
    kernel_name = name.removeprefix(ULYSSES_PREFIX)
    kernel = ALL_ATTENTION_FUNCTIONS[kernel_name]
    if sequence_shard is None:
        view = ModuleView(
            module, module.num_key_value_groups, ConfigView(module.config, kernel_name)
        )
        # An attention function returns (output, attention weights or None).
        return cast(
            "tuple[torch.Tensor, torch.Tensor | None]",
            kernel(view, query, key, value, attention_mask, **kwargs),
        )
    sp = sequence_shard.sp
    key, value = repeat_kv_heads(key, sp.size), repeat_kv_heads(value, sp.size)
    # Sequence slice -> head slice: [b, h, L/size, d] -> [b, h/size, L, d].
    query, key, value = (Exchange.apply(t, 1, 2, sp.group) for t in (query, key, value))
    view = ModuleView(
        module, query.shape[1] // key.shape[1], ConfigView(module.config, kernel_name)
    )
    if sequence_shard.kernel_kwargs:
        kwargs = {**kwargs, **sequence_shard.kernel_kwargs}
        attention_mask = kwargs.pop("attention_mask", None)
    out, _ = kernel(view, query, key, value, attention_mask, **kwargs)
    # Head slice -> sequence slice: [b, L, h/size, d] -> [b, L/size, h, d].
    # Function.apply is unannotated in torch; Exchange.forward returns a Tensor.
    return cast(torch.Tensor, Exchange.apply(out, 1, 2, sp.group)), None


@cache
def register_ulysses_attention(kernel: str) -> str:
    """Register the Ulysses wrapper of ``kernel`` (and, for forwards without a shard,
    ``kernel``'s own mask builder) with transformers; returns the name to load models with."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    name = ULYSSES_PREFIX + kernel
    AttentionInterface.register(name, ulysses_attention_forward)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[kernel])
    return name


class GatherTokens(torch.autograd.Function):
    """[n_r, ...] values of this rank's tokens -> [N, ...] of the group's, in layout order, on
    every rank; backward returns this rank's rows of the gradient (every rank computes the
    same loss from the same [N] values, so each token's gradient is taken once)."""

    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, owned: list[torch.Tensor], sp: SequenceParallel
    ) -> torch.Tensor:
        sizes = [len(o) for o in owned]
        width = max(1, *sizes)  # gloo cannot gather empty tensors
        padded = local.new_zeros(width, *local.shape[1:])
        padded[: len(local)] = local
        parts = [torch.empty_like(padded) for _ in range(sp.size)]
        dist.all_gather(parts, padded.contiguous(), group=sp.group)
        out = local.new_empty(sum(sizes), *local.shape[1:])
        for index, part, n in zip(owned, parts, sizes):
            out[index] = part[:n]
        ctx.mine = owned[sp.rank]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad[ctx.mine], None, None


class SumOverGroup(torch.autograd.Function):
    """All-reduce sum over a group (None: every rank); backward passes the gradient on
    unchanged: every rank computes the same loss from the same sum, so each rank's own
    addend takes the gradient once (summed over the group: once, as :class:`GatherTokens`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over every rank of the default group (differentiable: see
    :class:`SumOverGroup`): statistics of a micro-step that all training ranks share (the
    routers' load-balancing loss, :mod:`rlframe.algorithms.router`)."""
    return cast(torch.Tensor, SumOverGroup.apply(x, None))


def slice_bounds(length: int, sp: SequenceParallel) -> tuple[int, int, int]:
    """(slice length, padded tail, this rank's first position) of a sequence of ``length``
    padded at the end to a multiple of the group size."""
    local = -(-length // sp.size)
    return local, local * sp.size - length, sp.rank * local


def slice_token_mask(layout: SequenceLayout, sp: SequenceParallel) -> torch.Tensor:
    """[b * L / size] 1 on this rank's slice's real tokens, 0 on padding (a padded row's, and
    the tail that makes the length a multiple of the group size): which of the slice's
    positions per-token statistics (the routers') count."""
    rows, length = layout.input_ids.shape
    local, tail, begin = slice_bounds(length, sp)
    real = torch.ones(rows, length, dtype=torch.bool, device=layout.input_ids.device)
    if layout.attention_mask is not None:
        real = layout.attention_mask.bool()
    real = torch.nn.functional.pad(real, (0, tail), value=False)
    return real[:, begin : begin + local].reshape(-1).float()


@dataclass
class ShardedLayout:
    """This rank's slice of a :class:`SequenceLayout` (sequence padded to a multiple of the
    group size), and which of the layout's N selected tokens each rank predicts."""

    input_ids: torch.Tensor
    """[b, L / size] this rank's slice."""
    position_ids: torch.Tensor
    """[b, L / size] global positions of the slice."""
    attention_mask: torch.Tensor | None
    """sdpa: [b, 1, L, L] bool, the whole sequence's mask (built once, read by every layer),
    or None for one unpadded sequence (causal); flash: None (the kernel gets varlen lengths
    or a padding mask through the shard)."""
    shard: SequenceShard
    predict_index: torch.Tensor
    """[n_r] index into the slice's flattened [b * L / size] positions."""
    target_ids: torch.Tensor
    """[n_r] the tokens this rank predicts."""
    owned: list[torch.Tensor]
    """Per rank of the group, the indices into [N] of the tokens it predicts."""

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """[n_r] this rank's values -> [N] the group's (differentiable)."""
        # Function.apply is unannotated in torch; GatherTokens.forward returns a Tensor.
        return cast(torch.Tensor, GatherTokens.apply(values, self.owned, self.shard.sp))


def label_segments(layout: SequenceLayout) -> torch.Tensor:
    """[b, L] which sequence each position belongs to: packed rows are numbered, a padded
    row's real tokens are 0, padding is -1."""
    if layout.attention_mask is not None:
        return torch.where(layout.attention_mask.bool(), 0, -1)
    starts = (layout.position_ids == 0).long()
    return starts.cumsum(-1) - 1


def build_sdpa_mask(segments: torch.Tensor) -> torch.Tensor:
    """[b, 1, L, L] bool: causal, within one segment, never onto padding; every position
    sees itself, so padding rows have a finite softmax (they predict nothing)."""
    length = segments.shape[1]
    pos = torch.arange(length, device=segments.device)
    causal = pos[:, None] >= pos[None, :]
    same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, None, :] >= 0)
    return ((causal & same) | torch.eye(length, dtype=torch.bool, device=pos.device))[:, None]


def build_flash_kwargs(segments: torch.Tensor, packed: bool) -> dict[str, Any]:
    """The flash kernel's view of the whole sequence: varlen lengths for a packed row, the
    padding mask for padded rows."""
    if not packed:
        return {"attention_mask": (segments >= 0).long()}
    lengths = torch.unique_consecutive(segments[0], return_counts=True)[1]
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    longest = int(lengths.max())
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def continue_positions(position_ids: torch.Tensor, tail: int) -> torch.Tensor:
    """``position_ids`` [..., L] with ``tail`` more positions that count on from each row's
    last one. A tail of zeros would restart the positions: on a slice passed without a mask
    (one packed sequence under sdpa), transformers reads a restart as a second packed
    sequence and builds a mask of the slice's own length, which sdpa, seeing the whole
    sequence after the exchange, cannot broadcast (issue 45, item 2)."""
    steps = torch.arange(1, tail + 1, device=position_ids.device, dtype=position_ids.dtype)
    return torch.cat([position_ids, position_ids[..., -1:] + steps], dim=-1)


def shard_layout(layout: SequenceLayout, sp: SequenceParallel) -> ShardedLayout:
    """This rank's contiguous slice of every row of ``layout`` (on the layout's device)."""
    length = layout.input_ids.shape[1]
    local, tail, begin = slice_bounds(length, sp)
    segments = label_segments(layout)
    input_ids, position_ids = layout.input_ids, layout.position_ids
    if tail:
        pad = lambda t, v: torch.nn.functional.pad(t, (0, tail), value=v)  # noqa: E731
        input_ids, segments = pad(input_ids, 0), pad(segments, -1)
        position_ids = continue_positions(position_ids, tail)
        if layout.attention_mask is None:
            # The packed tail joins the last sequence: it comes after every real token, so
            # no real token sees it, and it predicts nothing.
            segments[:, length:] = segments[:, length - 1 : length]
    packed = layout.attention_mask is None
    if sp.kernel == "sdpa":
        # One sequence without padding (the long-response case) needs no mask: sdpa's
        # causal kernels then never hold [L, L] scores.
        single = not bool(segments.any())
        mask, kernel_kwargs = (None if single else build_sdpa_mask(segments)), {}
    else:
        mask, kernel_kwargs = None, build_flash_kwargs(segments, packed)
    row, col = layout.predict_index // length, layout.predict_index % length
    owner = col // local
    owned = [(owner == r).nonzero().squeeze(1) for r in range(sp.size)]
    mine = owned[sp.rank]
    return ShardedLayout(
        input_ids[:, begin : begin + local],
        position_ids[:, begin : begin + local],
        mask,
        SequenceShard(sp, kernel_kwargs),
        row[mine] * local + col[mine] - begin,
        layout.target_ids[mine],
        owned,
    )


def gather_group_rows(
    batch: TrainBatch, sp: SequenceParallel, block: int
) -> tuple[TrainBatch, torch.Tensor]:
    """The rows of the whole group (each rank's share, from DP_SPLIT), every ``block`` rows
    of each rank's share followed by the same block of the next rank's; and the indices of
    this rank's own rows in that order.

    With ``block`` = a rank's share of a mini-batch, the group's mini-batches hold the rows
    the ranks' mini-batches held: the split into mini-batches is that of ``size`` = 1.
    """
    from rlframe.core.train_batch import TrainBatch

    shares: list[Any] = [None] * sp.size
    dist.all_gather_object(shares, batch, group=sp.group)
    rows = len(batch)
    if any(len(s) != rows for s in shares):
        raise RuntimeError(
            f"ranks of a sequence-parallel group got {[len(s) for s in shares]} rows"
        )
    order = [
        r * rows + i
        for start in range(0, rows, block)
        for r in range(sp.size)
        for i in range(start, min(start + block, rows))
    ]
    own = torch.tensor([p for p, i in enumerate(order) if i // rows == sp.rank], dtype=torch.long)
    return TrainBatch.concat(shares).rows(order), own
