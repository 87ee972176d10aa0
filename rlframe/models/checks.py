"""Checks of the run's config against the model's own config (its ``config.json``): the
positions a row needs, what a vision-language model supports, and the attention heads a
sequence-parallel group splits; and :data:`MODEL_CHECKS`, every check against the model's
config, which preflight runs in order.

Each check is given the model's config and reads nothing else: preflight runs them before
Ray starts on the local ``config.json`` alone (:class:`rlframe.models.hf_config.ConfigJson`,
no transformers import), and again with transformers' config while the workers start (a hub
id, a tiny model built on first use, a field transformers derives). Each failure is a
:class:`ConfigError` naming the key; a model whose config cannot be read (``None``: a hub id
offline) passes what needs it, and vLLM or transformers say what is wrong later.

A new model-family feature adds its check to :data:`MODEL_CHECKS` (in the module of the
feature) instead of editing preflight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlframe.config import Config, ConfigError
from rlframe.models.expert_parallel import check_expert_parallel
from rlframe.models.hf_config import has_vision_tower
from rlframe.models.moe_families import check_moe_family
from rlframe.models.moe_routing import check_router_aux_loss, check_router_replay

ModelCheck = Callable[[Config, str, Any], None]
"""A check of the run's config against the model at a path, given that model's config (a
transformers config, :class:`~rlframe.models.hf_config.ConfigJson`, or None where it cannot
be read); raises ConfigError."""


def check_sequence_length(cfg: Config, model_path: str, config: Any) -> None:
    """The longest prompt + response must fit the model's positions (vLLM refuses to start
    otherwise, after Ray). Multi-turn responses hold observations too."""
    from rlframe.config.agent import compute_response_width, is_multi_turn

    if config is None:  # a model id whose config is not reachable: vLLM will say
        return
    # A vision-language model's positions are its language model's.
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    width = compute_response_width(cfg.rollout.max_tokens, cfg.rollout.agent, cfg.agent)
    longest = cfg.data.max_prompt_length + width
    if limit is not None and longest > limit:
        parts = (
            f"data.max_prompt_length {cfg.data.max_prompt_length} + "
            f"rollout.max_tokens {cfg.rollout.max_tokens}"
        )
        if is_multi_turn(cfg.rollout.agent):
            obs = width - cfg.rollout.max_tokens
            parts += f" + (agent.max_turns - 1) * agent.max_obs_tokens = {obs}"
        raise ConfigError(
            "agent.max_obs_tokens" if is_multi_turn(cfg.rollout.agent) else "rollout.max_tokens",
            f"{parts} = {longest} tokens exceeds the model's {limit} positions",
        )


def check_vision(cfg: Config, model_path: str, config: Any) -> None:
    """What only a vision-language model has: ``model.freeze_vision`` needs a vision tower;
    its rows (images, mrope) have no Ulysses split or critic path yet, and the ``openai``
    agent's server does not put images in its rows (its engine calls would send image pads
    without their images); ``single_turn`` and ``multi_turn`` do. LoRA adapts its language
    model alone (:mod:`rlframe.models.lora_targets`): the vision tower stays as loaded whatever
    ``model.freeze_vision`` says."""
    if config is None:
        return
    if not has_vision_tower(config):
        if cfg.model.freeze_vision:
            raise ConfigError("model.freeze_vision", f"{model_path} has no vision tower")
        return
    unsupported = {
        "actor.sequence_parallel_size": cfg.actor.sequence_parallel_size > 1,
        "critic.sequence_parallel_size": cfg.critic.sequence_parallel_size > 1,
        "critic.enable": cfg.critic.enable,
        "rollout.agent": cfg.rollout.agent == "openai",
        # The teacher stage sends token ids alone; image rows would lose their images.
        "distill.teacher": cfg.distill.enabled,
    }
    for key, used in unsupported.items():
        if used:
            raise ConfigError(key, f"not supported yet for a vision-language model ({model_path})")
    if cfg.rollout.sleep_level == 2 and (cfg.model.freeze_vision or cfg.model.lora.enabled):
        # Level 2 discards every weight of the sleeping engine; the push after waking skips a
        # tower that does not train (frozen, or under LoRA), so images would be embedded with
        # lost weights (the adapter sync's own guard, config/lora.py, covers the rest).
        raise ConfigError(
            "rollout.sleep_level",
            "2 discards the vision tower's weights, which the sync after waking does not send "
            "when the tower does not train (model.freeze_vision or LoRA): use 1",
        )


def check_sequence_parallel(cfg: Config, model_path: str, config: Any) -> None:
    """Ulysses hands each rank of a group ``heads / size`` attention heads: the size must
    divide the model's heads (key/value heads are repeated as needed). Sliding-window layers
    are refused: the mask the exchange builds is the full causal one."""
    sizes = {
        "actor.sequence_parallel_size": cfg.actor.sequence_parallel_size,
        "critic.sequence_parallel_size": cfg.critic.sequence_parallel_size,
    }
    sizes = {k: v for k, v in sizes.items() if v > 1}
    if not sizes or config is None:
        return
    config = getattr(config, "text_config", config)
    heads = getattr(config, "num_attention_heads", None)
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or [])
    for key, size in sizes.items():
        if heads is not None and heads % size:
            raise ConfigError(
                key, f"{size} must divide the model's {heads} attention heads ({model_path})"
            )
        if sliding:
            raise ConfigError(
                key, f"{size} > 1 is not supported for models with sliding-window layers"
            )


MODEL_CHECKS: tuple[ModelCheck, ...] = (
    # What a vision-language model cannot do yet goes first: it names the real limit where a
    # later check would name a symptom.
    check_vision,
    check_sequence_length,
    check_sequence_parallel,
    check_moe_family,
    check_expert_parallel,
    check_router_replay,
    check_router_aux_loss,
)
"""Every check of the config against the model's config, in the order preflight runs them
(the LoRA targets, which build the model on the meta device, are
:func:`rlframe.models.lora_targets.check_lora_targets`, run after these)."""


def run_model_checks(cfg: Config, model_path: str, config: Any) -> None:
    """Run :data:`MODEL_CHECKS` against the model at ``model_path``, whose config is
    ``config``."""
    for check in MODEL_CHECKS:
        check(cfg, model_path, config)
