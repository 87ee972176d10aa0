"""Training names and engine names of the weights: the one place that maps the two.

Training ``state_dict`` names carry the segments of module wrappers (torch.compile,
activation checkpointing) and of peft (``base_model.model.`` in front, ``base_layer`` /
``lora_A.default`` inside an adapted layer); the rollout engine's loader expects the names of
the HF checkpoint, and vLLM's LoRA loader those of a saved peft adapter.
"""

from __future__ import annotations

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


def to_adapter_name(train_name: str, adapter: str = "default") -> str:
    """The name of an adapter tensor in a saved peft adapter (and to vLLM's LoRA loader) for
    a training ``state_dict`` name: ``...q_proj.lora_A.default.weight`` ->
    ``...q_proj.lora_A.weight``, wrapper segments dropped, peft's prefix kept."""
    parts = [p for p in train_name.split(".") if p not in WRAPPER_SEGMENTS and p != adapter]
    return ".".join(parts)


VISION_TOWER_SEGMENT = "visual"
"""The module that holds a Qwen2-VL-style model's vision tower and merger (projector)."""


def is_vision_tower_name(train_name: str) -> bool:
    """Whether a training name belongs to the vision tower (or its merger)."""
    return VISION_TOWER_SEGMENT in train_name.split(".")
