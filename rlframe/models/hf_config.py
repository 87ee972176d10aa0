"""What the model's HF config says, for the driver's checks and the places that pick a model
class: the config read once per model folder, whether it is a vision-language model's, and
the name of its vision tower.

Several pre-flight checks (sequence length, sequence parallelism, expert parallelism, router
replay, vision) each need the config; reading and parsing ``config.json`` (or resolving a hub
id) once keeps start-up from doing it five times. Before Ray starts the same checks read
:class:`ConfigJson`, the local ``config.json``'s own fields, without transformers (whose
import takes torch with it, seconds that would delay Ray's start).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

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


class ConfigJson:
    """A model's ``config.json`` as attributes, as the checks read a transformers config:
    ``config.num_attention_heads``, ``config.text_config.max_position_embeddings``,
    ``config.get_text_config()``. Only the fields the file holds: a field transformers fills
    in from its defaults or derives (``layer_types`` from ``use_sliding_window``, GPT-2's
    ``n_head`` as ``num_attention_heads``) is missing here, and a check that needs it passes;
    the same check with transformers' config, after Ray, has the last word."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def __getattr__(self, name: str) -> Any:
        fields = self.__dict__.get("fields", {})
        if name not in fields:
            raise AttributeError(name)
        value = fields[name]
        return ConfigJson(value) if isinstance(value, dict) else value

    def get_text_config(self) -> Any:
        """The language model's part (``text_config``), else the whole config."""
        text = self.fields.get("text_config")
        return ConfigJson(text) if isinstance(text, dict) else self


def read_config_json(model_folder: str) -> ConfigJson | None:
    """The ``config.json`` of a local model folder (:class:`ConfigJson`); None when there is
    none or it does not parse (preflight names that later)."""
    try:
        fields = json.loads((Path(model_folder).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return ConfigJson(fields) if isinstance(fields, dict) else None


def has_vision_tower(config: PreTrainedConfig | ConfigJson | None) -> bool:
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
