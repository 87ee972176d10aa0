"""Recording a mixture-of-experts model's router logits during a training forward.

transformers declares, on each MoE model class, which module produces the router logits
(``_can_record_outputs["router_logits"]``: the router class and the index of the logits in
its output); the same declaration drives its own ``output_router_logits``. Hooks on those
modules collect the logits of one forward without changing how the forward is called (the
chunked LM head, FSDP2's root call, packing). A dense model has no such declaration: nothing
is hooked, nothing is recorded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class RouterSpec:
    """Where a model's router logits come from, and how many experts a token goes to."""

    router_class: type[nn.Module]
    output_index: int
    top_k: int


def find_router_spec(model: nn.Module) -> RouterSpec | None:
    """The router declaration of ``model`` (wrapped by FSDP2 or peft or not); None for a
    model without routed experts."""
    for module in model.modules():
        recorders = getattr(type(module), "_can_record_outputs", None) or {}
        recorder = recorders.get("router_logits")
        config = getattr(module, "config", None)
        top_k = getattr(config, "num_experts_per_tok", None)
        if recorder is not None and top_k:
            return RouterSpec(recorder.target_class, recorder.index or 0, int(top_k))
    return None


@contextmanager
def record_router_logits(model: nn.Module, spec: RouterSpec) -> Iterator[list[torch.Tensor]]:
    """Within the block, every forward of a router of ``model`` appends its ``[tokens,
    experts]`` logits (with their gradient) to the yielded list, in layer order. Leave the
    block before the backward: activation checkpointing re-runs the routers there."""
    recorded: list[torch.Tensor] = []

    def keep(
        _module: nn.Module, _args: tuple[Any, ...], output: tuple[Any, ...] | torch.Tensor
    ) -> None:
        logits = output[spec.output_index] if isinstance(output, tuple) else output
        recorded.append(logits.reshape(-1, logits.shape[-1]))

    handles = [
        module.register_forward_hook(keep)
        for module in model.modules()
        if isinstance(module, spec.router_class)
    ]
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()
