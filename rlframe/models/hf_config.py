"""What the model's HF config says, for the driver's checks and the places that pick a model
class: the config read once per model folder, whether it is a vision-language model's, and
the name of its vision tower.

Several pre-flight checks (sequence length, sequence parallelism, expert parallelism, router
replay, vision) each need the config; reading and parsing ``config.json`` (or resolving a hub
id) once keeps start-up from doing it five times.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedConfig


@lru_cache(maxsize=8)
def read_model_config(model_path: str, trust_remote_code: bool) -> PreTrainedConfig | None:
    """The transformers config of ``model_path``; None when it cannot be read here (a model
    id whose config is not reachable: the workers will say why). The checks only read it."""
    from transformers import AutoConfig

    try:
        # AutoConfig.from_pretrained is unannotated; it returns the model's config class.
        return cast(
            "PreTrainedConfig",
            AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code),
        )
    except Exception:
        return None


def has_vision_tower(config: PreTrainedConfig | None) -> bool:
    """Whether a transformers config is a vision-language model's (it holds a vision
    tower's config); False for None (no config)."""
    return getattr(config, "vision_config", None) is not None


def pick_policy_model_class(
    config: PreTrainedConfig,
) -> type[AutoModelForImageTextToText] | type[AutoModelForCausalLM]:
    """The transformers auto class a policy of ``config`` loads as: the image-text-to-text
    model of a vision-language model (the one that trains, tower included), else the causal
    LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if has_vision_tower(config) else AutoModelForCausalLM


VISION_TOWER_SEGMENT = "visual"
"""The module that holds a Qwen2-VL-style model's vision tower and its merger (projector)."""


def is_vision_tower_name(name: str) -> bool:
    """Whether a module or ``state_dict`` name belongs to the vision tower (or its merger)."""
    return VISION_TOWER_SEGMENT in name.split(".")
