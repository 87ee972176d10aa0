"""Routed experts of a mixture-of-experts model: record them, or replay recorded ones (R3).

transformers (5.x) routes each token in a module of its own per MoE layer, the router
(``mlp.gate``, a ``...TopKRouter``), whose forward returns ``(router_logits, top-k weights,
top-k expert indices)`` for the [tokens, hidden] states it is given. Both tools here are
forward hooks on those modules, so nothing inside transformers is patched:

- :class:`RoutingRecorder` keeps each forward's indices (the rollout engine's routing);
- :class:`RouterReplay` replaces them with recorded ones (the trainer under
  ``algorithm.router_replay=rollout``). As in Megatron's R3 (``RouterReplay`` in
  ``megatron/core/transformer/moe/router_replay.py``, which veRL's ``router_replay.mode=R3``
  drives): the *indices* are replayed, the *weights* of those experts are recomputed from the
  router's current logits, so the router still gets a gradient through the experts it chose.

Only routers that take the softmax over all experts and then the top-k (renormalised when
``norm_topk_prob``) are supported: :data:`rlframe.models.moe_routing.REPLAYABLE_MODEL_TYPES`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from rlframe.core.sequence_layout import SequenceLayout

ROUTER_SUFFIX = "TopKRouter"
"""The class-name suffix of transformers' MoE routers (Qwen3MoeTopKRouter, MixtralTopKRouter)."""


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order (dense layers have none)."""
    return [m for m in model.modules() if type(m).__name__.endswith(ROUTER_SUFFIX)]


def compute_replayed_weights(
    router: nn.Module, logits: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """[T, k] routing weights of the experts ``indices`` [T, k], from ``logits`` [T, E] the
    way the router weighs its own choice: softmax over all experts in fp32, the chosen
    experts' probabilities, renormalised to sum 1 when ``norm_topk_prob`` (routers without
    the attribute, Mixtral's, always renormalise), in the logits' dtype. Differentiable in
    ``logits``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    chosen = probs.gather(1, indices)
    if getattr(router, "norm_topk_prob", True):
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return chosen.to(logits.dtype)


class RoutingRecorder:
    """Forward hooks that keep the top-k indices every router returns, call after call.

    :meth:`take` hands back what the forwards since the last ``take`` routed: [tokens,
    routers, k] int16, tokens in the order the forwards saw them (a prefill's prompt, then one
    token per decoding step)."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = find_routers(model)
        self.calls: list[list[torch.Tensor]] = []
        self.clear()
        self.handles: list[RemovableHandle] = [
            router.register_forward_hook(self.make_hook(i)) for i, router in enumerate(self.routers)
        ]

    def make_hook(
        self, layer: int
    ) -> Callable[[nn.Module, tuple[Any, ...], tuple[Any, ...]], None]:
        def keep(module: nn.Module, args: tuple[Any, ...], output: tuple[Any, ...]) -> None:
            self.calls[layer].append(output[2].detach().to("cpu", torch.int16))

        return keep

    def take(self) -> torch.Tensor:
        """[tokens, routers, k] indices recorded since the last call; empties the record."""
        per_layer = [torch.cat(calls) for calls in self.calls]
        self.clear()
        return torch.stack(per_layer, dim=1)

    def clear(self) -> None:
        """Forget what was recorded so far."""
        self.calls = [[] for _ in self.routers]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class ReplayTarget(NamedTuple):
    """One forward's replayed routing, prepared once (per micro-batch, not per layer)."""

    indices: torch.Tensor
    """[tokens, routers, k] int64 on the routers' device; -1 where nothing was recorded."""
    recorded: torch.Tensor
    """[tokens, routers] bool: the token-layers whose recorded experts are replayed."""


class RouterReplay:
    """Forward hooks that route tokens to recorded experts while :meth:`replaying` is active.

    The target is [tokens, routers, k] for the tokens of the forward, flattened as the model
    flattens them ([b, L] -> b * L). A token whose target row holds -1 (padding, or the last
    response token, which the rollout never fed back) keeps the router's own choice. The
    hooks also count how often the router's own choice (its top-k set) agrees with the
    target: :meth:`take_agreement`.

    The hooks never wait for the device (no ``.item()``, no boolean indexing, no host copy):
    the target is checked and moved once per :meth:`replaying` block, and the agreement is
    counted on the device and read once by :meth:`take_agreement`. Each such wait per MoE
    layer stalls a GPU's queue, twice per layer under gradient checkpointing
    (bench/router_replay_syncs.py counts them).
    """

    def __init__(self, model: nn.Module) -> None:
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError(
                f"{type(model).__name__} has no MoE router (*{ROUTER_SUFFIX}): nothing to replay"
            )
        self.experts = min(int(getattr(r, "num_experts", 0) or 0) for r in self.routers)
        """Experts per router (0: not declared, indices left unchecked)."""
        self.target: ReplayTarget | None = None
        self.counts: torch.Tensor | None = None
        """[2] int64 on the device: (agreed, compared) since the last :meth:`take_agreement`."""
        self.handles = [
            router.register_forward_hook(self.make_hook(i)) for i, router in enumerate(self.routers)
        ]

    @contextmanager
    def replaying(self, target: torch.Tensor | None) -> Iterator[None]:
        """Replay ``target`` [tokens, routers, k] in the forwards (and the recomputations a
        backward under gradient checkpointing makes) inside the block; None: route freely."""
        prepared = None if target is None else self.prepare(target)
        # Restored, not cleared, on exit: a forward's replay may sit inside the update's,
        # which also covers the backward.
        outer, self.target = self.target, prepared
        try:
            yield
        finally:
            self.target = outer

    def prepare(self, target: torch.Tensor) -> ReplayTarget:
        """Check ``target`` once and move it to the routers' device as int64. The check reads
        values only while they are on the host (a layout's routing arrives there)."""
        if target.dim() != 3:
            raise ValueError(f"routed_experts must be [tokens, MoE layers, k], got {target.shape}")
        if target.shape[1] != len(self.routers):
            raise ValueError(
                f"routed_experts has {target.shape[1]} MoE layers, the model {len(self.routers)}"
            )
        if target.device.type == "cpu" and target.numel() and self.experts:
            low, high = int(target.min()), int(target.max())
            if low < -1 or high >= self.experts:
                raise ValueError(
                    f"routed_experts holds expert ids in [{low}, {high}]; the model's routers "
                    f"have {self.experts} experts (-1: not recorded)"
                )
        device = next(self.routers[0].parameters()).device
        indices = target.to(device, torch.long, non_blocking=True)
        return ReplayTarget(indices, (indices >= 0).all(-1))

    def make_hook(
        self, layer: int
    ) -> Callable[[nn.Module, tuple[Any, ...], tuple[Any, ...]], tuple[Any, ...] | None]:
        def replay(
            module: nn.Module, args: tuple[Any, ...], output: tuple[Any, ...]
        ) -> tuple[Any, ...] | None:
            if self.target is None:
                return None
            logits, _, native = output
            target, recorded = self.target.indices[:, layer], self.target.recorded[:, layer]
            if target.shape[0] != native.shape[0]:  # shapes are host metadata: no wait
                raise ValueError(
                    f"routed_experts covers {target.shape[0]} tokens, the forward has "
                    f"{native.shape[0]}"
                )
            if target.device != native.device:  # a model moved since replaying() began
                self.target = ReplayTarget(
                    self.target.indices.to(native.device), self.target.recorded.to(native.device)
                )
                target, recorded = target.to(native.device), recorded.to(native.device)
            self.count_agreement(native, target, recorded)
            indices = torch.where(recorded[:, None], target, native)
            return logits, compute_replayed_weights(module, logits, indices), indices

        return replay

    @torch.no_grad()
    def count_agreement(
        self, native: torch.Tensor, target: torch.Tensor, recorded: torch.Tensor
    ) -> None:
        """Add the recorded tokens whose own top-k set equals the target's, on the device."""
        same = (native.sort(-1).values == target.sort(-1).values).all(-1) & recorded
        counts = torch.stack([same.sum(), recorded.sum()])
        self.counts = counts if self.counts is None else self.counts + counts

    def take_agreement(self) -> float | None:
        """The share of (token, MoE layer) pairs replayed since the last call whose router,
        left alone, would have chosen the same experts; None when nothing was replayed.
        Reads the device's counts: one wait, per micro-batch."""
        counts, self.counts = self.counts, None
        if counts is None:
            return None
        agreed, compared = counts.tolist()
        return agreed / compared if compared else None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@contextmanager
def replay_layout(replay: RouterReplay | None, layout: SequenceLayout) -> Iterator[None]:
    """Forwards (and backward recomputations) inside route the layout's tokens to its
    ``routed_experts``; a no-op without router replay (``replay`` None). With it, a layout
    without routing is refused rather than routed freely unnoticed."""
    if replay is None:
        yield
        return
    if layout.routed_experts is None:
        raise ValueError(
            "algorithm.router_replay=rollout, but the rows carry no routed_experts: the "
            "rollout engine did not record routing, or a stage dropped it"
        )
    with replay.replaying(layout.flat_routed_experts()):
        yield
