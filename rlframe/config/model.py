"""The ``model`` section: which weights the workers load and how the training model is built."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from rlframe.config.checks import require
from rlframe.config.lora import LoraConfig


@dataclass
class ModelConfig:
    path: str = MISSING
    """HF model id or local directory loaded with ``from_pretrained`` by the workers."""
    dtype: str = "auto"
    """Training parameter dtype: auto (bf16 on cuda, fp32 on cpu), float32 or bfloat16."""
    trust_remote_code: bool = False
    """Passed to transformers when loading the model and tokenizer."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    freeze_vision: bool = False
    """A vision-language model's vision tower (patch embedding, blocks, merger) stays as
    loaded: not trained, and not sent at weight syncs (the engine keeps its copy)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters on the policy (``lora.rank > 0``); the reference is then the same
    model with its adapters off."""

    def __post_init__(self) -> None:
        allowed = ("auto", "float32", "bfloat16")
        require(
            self.dtype in allowed, "model.dtype", f"must be one of {allowed}, got {self.dtype!r}"
        )
