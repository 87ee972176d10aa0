"""Expert parallelism of the training model (``actor.expert_parallel_size``).

The ranks form a replica x expert mesh of (world / E) x E: each group of E consecutive ranks
holds every routed expert of a layer once, rank i of the group experts [i * n, (i + 1) * n)
with n = experts / E, whole, as plain (not FSDP) parameters with their own gradients and
optimizer state. The dense parameters (attention, norms, routers, shared experts) stay
FSDP2-sharded over all ranks as before; the expert parameters are left out of it
(``ignored_params``).

In a layer's forward the router runs on every rank for its own tokens, then each (token,
chosen expert) pair is sent to the rank that holds the expert with an all-to-all of the
expert group, the experts run there, and the outputs come back by the reverse all-to-all and
are combined with the routing weights. Both all-to-alls are differentiable
(``all_to_all_single_autograd``; ``torch.distributed.nn``'s is deprecated in torch 2.13), so
the backward sends each output gradient back along the same path.

Gradient scale: FSDP2 averages a dense gradient over the W ranks. An expert's gradient is
the sum of what every rank's tokens contributed through the all-to-all (within its expert
group), all-reduced over its replicas (the same expert in the other groups), then divided by
W: the dense convention, so the update is the one EP 1 makes.

This is rlframe's own and not transformers 5.19's ``DistributedConfig(ep_size=...)``: that
path builds its own device mesh and applies FSDP2 itself from ``from_pretrained`` with the
model's ``_fsdp_plan``, which would take the sharding, the rank-0 load and the order of
rlframe's model transforms (LoRA, checkpointing, Ulysses) out of
:mod:`workers.training.model_build` (docs/moe.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard


@dataclass
class ExpertShard:
    """One MoE layer's experts module, cut down to this rank's experts."""

    name: str
    """The module's name in the model (``model.layers.0.mlp.experts``)."""
    module: nn.Module
    total: int
    """Routed experts of the layer (all ranks of the group together)."""


class ExpertParallel:
    """The expert groups of this process and the expert-sharded modules of one model."""

    def __init__(self, size: int, device: str) -> None:
        world = dist.get_world_size()
        if world % size:
            raise ValueError(f"actor.expert_parallel_size={size} must divide the {world} ranks")
        mesh = init_device_mesh(device, (world // size, size), mesh_dim_names=("replica", "expert"))
        self.mesh = mesh
        self.size = size
        self.world = world
        self.group = mesh.get_group("expert")
        self.replicas = mesh.get_group("replica")
        self.index = mesh.get_local_rank("expert")
        """This rank's place in its expert group: it holds the index-th slice of experts."""
        self.shards: list[ExpertShard] = []
        self.pending: dict[int, Pending] = {}
        """Per experts module (by id) in a forward: what its combine needs from its dispatch."""

    def describe(self) -> str:
        return f"replica x expert {self.world // self.size} x {self.size}"

    def apply(self, model: nn.Module) -> None:
        """Keep this rank's experts of every MoE layer of ``model`` and route tokens to them."""
        for name, module in find_expert_modules(model):
            total = count_experts(module)
            if total % self.size:
                raise ValueError(
                    f"{name}: {total} experts do not split over expert_parallel_size={self.size}"
                )
            local = total // self.size
            first = self.index * local
            for param_name, param in list(module.named_parameters(recurse=False)):
                kept = param.detach()[first : first + local].clone()
                setattr(module, param_name, nn.Parameter(kept, requires_grad=param.requires_grad))
            # The experts' own forward now sees local experts 0..local-1 only.
            setattr(module, "num_experts", local)  # noqa: B010 (a plain attribute of the module)
            module.register_forward_pre_hook(self.dispatch, with_kwargs=True)
            module.register_forward_hook(self.combine, with_kwargs=True)
            self.shards.append(ExpertShard(name, module, total))
        if not self.shards:
            raise ValueError(f"{type(model).__name__} has no experts module to split")

    def params(self) -> list[nn.Parameter]:
        """This rank's expert parameters (left out of FSDP2)."""
        return [p for shard in self.shards for p in shard.module.parameters(recurse=False)]

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether a ``state_dict`` tensor is (a view of) one of this rank's expert slices:
        known by its storage, whatever wrappers put in its name."""
        return any(tensor.data_ptr() == p.data_ptr() for p in self.params())

    def param_names(self, model: nn.Module) -> set[str]:
        """The fully qualified names of this rank's expert parameters in ``model``."""
        held = {id(p) for p in self.params()}
        return {name for name, p in model.named_parameters() if id(p) in held}

    def as_global(self, tensor: torch.Tensor) -> DTensor:
        """An expert slice (or its optimizer state) as the slice of the whole [experts, ...]
        tensor it is, without a copy: what a sharded checkpoint writes and reads, so that it
        loads at another expert-parallel size too (DCP reshards)."""
        return DTensor.from_local(tensor, self.mesh, [Replicate(), Shard(0)], run_check=False)

    # -- the forward ------------------------------------------------------------------

    def dispatch(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Send each (token, chosen expert) pair to the expert's rank; the experts module
        then runs on what arrived, one expert per row with weight 1."""
        hidden, top_k_index, top_k_weights = read_expert_args(args, kwargs)
        local = count_experts(module)
        total = local * self.size
        flat = top_k_index.reshape(-1)
        # Sorted by expert = grouped by owner rank, each rank's experts in order.
        order = torch.argsort(flat, stable=True)
        send = hidden[order // top_k_index.shape[-1]]
        counts = torch.bincount(flat, minlength=total)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send_sizes = counts.view(self.size, local).sum(1).tolist()
        recv_sizes = recv_counts.view(self.size, local).sum(1).tolist()
        received = all_to_all_single_autograd(send, recv_sizes, send_sizes, self.group)
        expert_ids = torch.arange(local, device=hidden.device).repeat(self.size)
        expert_ids = expert_ids.repeat_interleave(recv_counts)
        self.pending[id(module)] = Pending(
            order, top_k_weights, send_sizes, recv_sizes, hidden.dtype
        )
        # The experts are not FSDP2's: no mixed-precision cast reaches them, so the tokens
        # meet them in the experts' own dtype (fp32 master weights) and go back as they came.
        dtype = next(iter(module.parameters())).dtype
        weights = torch.ones((len(expert_ids), 1), dtype=dtype, device=hidden.device)
        return (received.to(dtype), expert_ids[:, None], weights), {}

    def combine(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> torch.Tensor:
        """Bring the expert outputs back to their tokens and weigh them by the routing."""
        order, top_k_weights, send_sizes, recv_sizes, dtype = self.pending.pop(id(module))
        output = output.to(dtype)
        back = all_to_all_single_autograd(output, send_sizes, recv_sizes, self.group)
        # Undo the sort: row j of ``back`` belongs to (token, slot) order[j].
        slots = torch.empty_like(back).index_copy(0, order, back)
        tokens, k = top_k_weights.shape
        slots = slots.view(tokens, k, -1) * top_k_weights[..., None].to(slots.dtype)
        combined: torch.Tensor = slots.sum(1)
        return combined

    # -- after the backward -----------------------------------------------------------

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Sum each expert gradient over its replicas and divide by the ranks (the dense
        gradients' mean, see the module docstring). A rank whose experts received no token
        has no gradient: it takes part with zeros."""
        for param in self.params():
            if not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            if self.world > self.size:
                dist.all_reduce(param.grad, group=self.replicas)
            param.grad.div_(self.world)

    @torch.no_grad()
    def grad_norm_squared(self) -> torch.Tensor:
        """The squared norm of all experts' gradients, every expert counted once (a
        collective of the expert group)."""
        grads = [p.grad for p in self.params() if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        total = sum((g.float().pow(2).sum() for g in grads), torch.zeros((), device=device))
        dist.all_reduce(total, group=self.group)
        return total

    @torch.no_grad()
    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The full [experts, ...] tensor of one expert parameter (a collective of the
        expert group): the weight sync and the export send whole tensors."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts)


class Pending(NamedTuple):
    """What a dispatch leaves for its combine: the sort of the (token, slot) pairs, the
    routing weights, the all-to-all sizes, the tokens' dtype."""

    order: torch.Tensor
    top_k_weights: torch.Tensor
    send_sizes: list[int]
    recv_sizes: list[int]
    dtype: torch.dtype


def count_experts(module: nn.Module) -> int:
    """The experts a transformers experts module runs (its ``num_experts``)."""
    return int(getattr(module, "num_experts"))  # noqa: B009 (not a Module attribute to mypy)


def read_expert_args(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden states [T, H], top-k expert ids [T, K], top-k weights [T, K]) of an experts
    call, however they were passed."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    values = list(args) + [kwargs[n] for n in names[len(args) :]]
    hidden, index, weights = values[:3]
    return hidden, index, weights


def find_expert_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every transformers experts module: named ``experts``, with ``num_experts`` and
    parameters whose first dimension is the expert."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "experts" or not hasattr(module, "num_experts"):
            continue
        params = list(module.parameters(recurse=False))
        if params and all(p.shape[0] == module.num_experts for p in params):
            yield name, module


def find_expert_parallel(model: nn.Module) -> ExpertParallel | None:
    """The :class:`ExpertParallel` a model was split by (None: its experts are whole)."""
    plan = getattr(model, "rlframe_expert_parallel", None)
    return plan if isinstance(plan, ExpertParallel) else None


def clip_split_gradients(
    params: list[nn.Parameter], plan: ExpertParallel, max_norm: float
) -> float:
    """Finish the expert gradients (:meth:`ExpertParallel.reduce_gradients`), then clip all
    gradients by their global norm: the dense ones' (FSDP2 DTensors, over all ranks) and the
    experts' (plain, each held by one rank of a group) together. Returns that norm."""
    from workers.training.dtensor_gather import full_tensor

    plan.reduce_gradients()
    held = {id(p) for p in plan.params()}
    dense = [p for p in params if id(p) not in held and p.grad is not None]
    experts = [p for p in params if id(p) in held and p.grad is not None]
    dense_norm = full_tensor(
        torch.nn.utils.get_total_norm([g for p in dense if (g := p.grad) is not None])
    )
    norm = torch.sqrt(dense_norm.float().pow(2) + plan.grad_norm_squared().to(dense_norm.device))
    # Two calls: foreach kernels do not mix DTensor and plain gradients.
    for group in (dense, experts):
        if group:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return float(norm)
