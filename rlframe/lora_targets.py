"""Which linear layers of a model can carry LoRA adapters: checked on the driver before Ray
starts, from the model's config alone (the model is built on the meta device, no weights)."""

from __future__ import annotations

from rlframe.config import Config, ConfigError, first_line


def list_decoder_linear_names(model_path: str, trust_remote_code: bool) -> list[str]:
    """The distinct last name segments of the ``nn.Linear`` layers inside the decoder blocks
    (``q_proj``, ``down_proj``...): what ``target_modules`` may name. The LM head is outside
    the blocks, and so out of reach (peft's ``all-linear`` leaves it out too)."""
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    # The layer lookup the engine shards by (workers/engines/fsdp.py, LAYER_LIST_NAMES).
    blocks = ("layers", "h", "blocks")
    names = set()
    for name, module in model.named_modules():
        parts = name.split(".")
        if isinstance(module, nn.Linear) and any(p in blocks for p in parts[:-1]):
            names.add(parts[-1])
    return sorted(names)


def check_lora_targets(cfg: Config, model_path: str) -> None:
    """``model.lora.target_modules`` and ``critic.lora.target_modules`` name linear layers
    the model's decoder has; raise ConfigError naming the key otherwise."""
    sections = [("model.lora", cfg.model.lora)]
    if cfg.critic.enable:
        sections.append(("critic.lora", cfg.critic.lora))
    for key, lora in sections:
        if not lora.enabled or not lora.target_modules:
            continue
        try:
            known = list_decoder_linear_names(model_path, cfg.model.trust_remote_code)
        except Exception as e:  # an architecture transformers cannot build from its config
            raise ConfigError("model.path", f"cannot list its layers: {first_line(e)}") from None
        unknown = [n for n in lora.target_modules if n not in known]
        if unknown:
            raise ConfigError(
                f"{key}.target_modules",
                f"no linear layer named {unknown} in the model's decoder; its linear layers: "
                f"{known} (leave the list empty for all of them)",
            )
