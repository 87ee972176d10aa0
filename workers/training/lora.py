"""LoRA on the training engine (peft): the adapters, what trains, the reference as the same
model with its adapters off, and the weights the rollout engine gets from them.

The wrapped model is a ``peft.PeftModel`` whose training names carry peft's segments
(``base_model.model.`` in front, ``base_layer`` / ``lora_A.default`` inside an adapted
layer); :class:`workers.model_hooks.weight_names.CheckpointLayout` maps them back to the HF names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from rlframe.config.lora import LoraConfig
from rlframe.models.hf_config import is_vision_tower_name
from workers.model_hooks.weight_names import CheckpointLayout, to_adapter_name
from workers.training.dtensor_gather import full_tensor
from workers.training.hf_model import HFModel

if TYPE_CHECKING:
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import PreTrainedModel


def apply_lora(model: PreTrainedModel, cfg: LoraConfig, head: str = "lm") -> PeftModel:
    """The model with adapters on its target layers; only the adapters require grad.

    A step of building the training model, before gradient checkpointing and FSDP2 sharding
    (see :func:`workers.training.model_build.build_train_model`): the adapters must exist when the
    layers are sharded, so that each layer's shard holds its adapters too.
    """
    from peft import get_peft_model

    from rlframe.models.lora_targets import list_peft_targets

    return get_peft_model(model, cfg.to_peft(head, list_peft_targets(model, cfg)))


@contextlib.contextmanager
def adapters_disabled(model: HFModel) -> Iterator[None]:
    """The base model: the reference policy is the policy with its adapters off, not a
    second copy of the weights."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise TypeError(f"{type(model).__name__} has no adapters to disable (apply_lora)")
    with model.disable_adapter():
        yield


def list_lora_layers(model: nn.Module) -> dict[str, LoraLayer]:
    """Module name -> peft LoRA layer (the ``nn.Linear`` wrappers that hold base and adapter)."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def is_adapter_entry(name: str) -> bool:
    """A ``state_dict`` entry of an adapter (``lora_A``, ``lora_B``...), not of the base."""
    return any(part.startswith("lora_") for part in name.split("."))


def iter_merged_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every base weight with its adapter merged in, as ``(HF name, full tensor)``; a vision
    tower's weights are left out (they take no adapters and never change: the engine keeps
    the copy it loaded, see :mod:`rlframe.models.lora_targets`).

    ``W + scaling * B @ A`` is computed on the gathered tensors, on the side: the training
    weights are never merged and unmerged in place, so the frozen base stays bit-exact.
    Gathering is a collective: every rank must walk the whole stream in the same order.
    """
    layers = list_lora_layers(model)
    layout = CheckpointLayout(model)
    state = model.state_dict()
    for name, value in state.items():
        if is_adapter_entry(name) or is_vision_tower_name(name):
            continue
        tensor = full_tensor(value).detach()
        owner = name.removesuffix(".base_layer.weight")
        if owner != name and owner in layers:
            layer = layers[owner]
            for adapter in layer.active_adapters:
                a = full_tensor(state[f"{owner}.lora_A.{adapter}.weight"]).detach()
                b = full_tensor(state[f"{owner}.lora_B.{adapter}.weight"]).detach()
                tensor = tensor + (b.float() @ a.float()).to(tensor.dtype) * layer.scaling[adapter]
        yield from layout.to_engine_tensors(name, tensor)


def iter_adapter_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter tensors alone, under the names of a saved peft adapter
    (``base_model.model.<layer>.lora_A.weight``), which vLLM's LoRA loader reads."""
    for name, value in model.state_dict().items():
        if is_adapter_entry(name):
            yield to_adapter_name(name), full_tensor(value).detach()
