"""Training names and engine names of the weights: the one place that maps the two.

Training ``state_dict`` names carry the segments of module wrappers (torch.compile,
activation checkpointing) and of peft (``base_model.model.`` in front, ``base_layer`` /
``lora_A.default`` inside an adapted layer); the rollout engine's loader expects the names of
the HF checkpoint, and vLLM's LoRA loader those of a saved peft adapter.

Layouts too: transformers 5 holds a mixture-of-experts layer's experts fused and renames
some modules, while each family's checkpoint, which ``save_pretrained`` writes and vLLM's
loader reads, keeps its own layout. :class:`CheckpointLayout` maps one to the other with
transformers' own conversion, reversed, so the engine receives exactly what it loads from
disk, for every family (docs/moe.md lists those checked against vLLM).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Module wrappers that insert a path segment into training names but not into checkpoints:
# torch.compile and activation-checkpoint wrappers.
WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module"})


# What peft puts around the HF model (``base_model.model.``) and around an adapted layer's
# original weights (``q_proj.base_layer.weight``).
PEFT_PREFIX = "base_model.model."
PEFT_BASE_SEGMENT = "base_layer"


def to_engine_name(train_name: str) -> str:
    """The name the rollout engine's loader expects (the HF checkpoint name) for a training
    ``state_dict`` name. This is the one place that maps the two."""
    name = train_name.removeprefix(PEFT_PREFIX)
    skip = WRAPPER_SEGMENTS | {PEFT_BASE_SEGMENT}
    return ".".join(part for part in name.split(".") if part not in skip)


def find_hf_model(model: torch.nn.Module) -> PreTrainedModel | None:
    """The transformers model inside ``model`` (itself, or the one peft wraps), None if none."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    return None


class CheckpointLayout:
    """transformers' own map between a model's layout in memory and its checkpoint's, one
    ``state_dict`` entry at a time: what ``save_pretrained`` writes, and what vLLM's loader
    reads for every family both serve.

    transformers 5 fuses a mixture-of-experts layer's experts in memory
    (``mlp.experts.gate_up_proj`` [experts, 2 * inter, hidden]) and renames modules
    (Mixtral's ``block_sparse_moe`` is ``mlp``), while checkpoints keep each family's own
    layout (``block_sparse_moe.experts.{e}.w1.weight``, ``mlp.experts.{e}.gate_proj.weight``,
    gpt-oss's fused and transposed experts). Each family registers the conversion it loads
    with (``transformers/conversion_mapping.py``); reversed, it gives the checkpoint's tensors,
    so the sync sends the engine exactly what it would load from disk, whatever the family.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = find_hf_model(model)
        if self.model is not None:
            check_streamable(self.model)

    def to_engine_tensors(
        self, train_name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The ``(engine name, tensor)`` pairs of one training ``state_dict`` entry."""
        from transformers.core_model_loading import revert_weight_conversion

        name = to_engine_name(train_name)
        if self.model is None:
            yield name, tensor
            return
        yield from revert_weight_conversion(self.model, {name: tensor}).items()


def check_streamable(model: PreTrainedModel) -> None:
    """Raise ValueError when a checkpoint tensor of ``model`` is made of several in-memory
    tensors (a conversion that splits one checkpoint tensor on load): the sync streams one
    entry at a time and could not rebuild it. No mixture-of-experts family does this."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    names = list(model.state_dict())
    for conversion in get_model_conversion_mapping(model, add_legacy=False):
        if not isinstance(conversion, WeightConverter) or len(conversion.target_patterns) < 2:
            continue
        # Loading splits one checkpoint tensor into these targets; saving must join them.
        targets = [
            re.compile(re.escape(p).replace(r"\*", r"\d+")) for p in conversion.target_patterns
        ]
        if any(t.search(n) for t in targets for n in names):
            raise ValueError(
                f"{model.config.model_type}: transformers splits the checkpoint tensor "
                f"{conversion.source_patterns} into {conversion.target_patterns} on load; "
                "rlframe's weight sync streams one tensor at a time and cannot join them"
            )


class ModelSlots:
    """Where each checkpoint (engine) tensor lands in a transformers model's own parameters:
    the inverse of :class:`CheckpointLayout`, for an engine that holds the transformers model
    itself (the hf engine). A parameter the layout only renames (found on the meta device, at
    no cost) is copied whole; for one it converts (fused experts), the layout is run once on an
    index tensor of it, so any split, slice or transpose maps back to the elements it came
    from."""

    def __init__(self, model: torch.nn.Module) -> None:
        layout = CheckpointLayout(model)
        self.slots: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for name, param in model.state_dict().items():
            shape = torch.empty(param.shape, device="meta")
            renamed = list(layout.to_engine_tensors(name, shape))
            if len(renamed) == 1 and renamed[0][1] is shape:
                self.slots[renamed[0][0]] = (param, None)
                continue
            index = torch.arange(param.numel()).view(param.shape)
            for engine_name, taken in layout.to_engine_tensors(name, index):
                self.slots[engine_name] = (param, taken.reshape(-1))

    @torch.no_grad()
    def load(self, engine_name: str, tensor: torch.Tensor) -> None:
        """Copy one engine tensor into the elements of the parameter it came from."""
        param, index = self.slots[engine_name]
        if index is None:
            param.copy_(tensor)
        else:
            param.view(-1).index_copy_(0, index, tensor.reshape(-1).to(param.dtype))


def to_adapter_name(train_name: str, adapter: str = "default") -> str:
    """The name of an adapter tensor in a saved peft adapter (and to vLLM's LoRA loader) for
    a training ``state_dict`` name: ``...q_proj.lora_A.default.weight`` ->
    ``...q_proj.lora_A.weight``, wrapper segments dropped, peft's prefix kept."""
    parts = [p for p in train_name.split(".") if p not in WRAPPER_SEGMENTS and p != adapter]
    return ".".join(parts)
