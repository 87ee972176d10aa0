"""``rollout.expert_parallel`` and ``actor.expert_parallel_size`` point at a mixture-of-experts
model: checked on the driver before Ray starts, from the model's config (vLLM refuses nothing
for a dense model and would run it tensor-parallel as before, so a wrong model would pass
unseen), and the trainer's expert groups split the experts evenly."""

from __future__ import annotations

from typing import Any

from rlframe.config import Config, ConfigError

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Where a transformers config holds its routed experts per layer (Qwen-MoE; Mixtral and
gpt-oss; DeepSeek)."""


def count_routed_experts(config: object) -> int:
    """The routed experts per MoE layer of a transformers config (its text part), 0 if dense."""
    config = getattr(config, "text_config", config)
    return max((getattr(config, key, None) or 0 for key in EXPERT_COUNT_KEYS), default=0)


def check_expert_parallel(cfg: Config, model_path: str, config: Any) -> None:
    """Raise ConfigError for ``rollout.expert_parallel`` or ``actor.expert_parallel_size`` (or
    ``critic.expert_parallel_size``) > 1
    on a model without experts, or for an expert-parallel size that does not divide the
    experts. A model whose config cannot be read here (``config`` None) is left to the
    workers."""
    if config is None:
        return
    experts = count_routed_experts(config)
    if cfg.rollout.expert_parallel and experts == 0:
        raise ConfigError(
            "rollout.expert_parallel",
            f"{model_path} has no experts (a dense model): set it false",
        )
    for key, ep in (
        ("actor.expert_parallel_size", cfg.actor.expert_parallel_size),
        ("critic.expert_parallel_size", cfg.critic.expert_parallel_size),
    ):
        if ep > 1 and experts == 0:
            raise ConfigError(key, f"{model_path} has no experts (a dense model): set it 1")
        if ep > 1 and experts % ep:
            raise ConfigError(
                key, f"{ep} must divide the model's {experts} experts per layer ({model_path})"
            )
