"""The root of the schema, the batch-size checks across sections, and ``build_config``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, get_type_hints

from omegaconf import DictConfig, OmegaConf

from rlframe.config.agent import AgentConfig
from rlframe.config.algorithm import AlgorithmConfig, check_router_replay_setup
from rlframe.config.checks import (
    ConfigError,
    check_renamed_key,
    first_line,
    list_dotted_keys,
    require,
)
from rlframe.config.distill import DistillConfig
from rlframe.config.lora import check_adapter_sync, check_lora
from rlframe.config.model import ModelConfig
from rlframe.config.placement import check_placement
from rlframe.config.reward import RewardConfig
from rlframe.config.rollout import RolloutConfig, check_async, check_sync_gap
from rlframe.config.sections import (
    ActorConfig,
    CriticConfig,
    DataConfig,
    RayConfig,
    TrainerConfig,
    ValConfig,
)
from rlframe.config.served import check_served
from rlframe.core.names import GROUP_RELATIVE, NEEDS_CRITIC


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    val: ValConfig = field(default_factory=ValConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        a = self.algorithm
        require(
            self.rollout.n > 1 or a.advantage not in GROUP_RELATIVE,
            "rollout.n",
            f"algorithm.advantage={a.advantage} compares the responses to one prompt: with "
            "rollout.n=1 every advantage is 0 and nothing is learned; set rollout.n >= 2",
        )
        require(
            a.advantage != "grpo_passk" or a.pass_k <= self.rollout.n,
            "algorithm.pass_k",
            f"{a.pass_k} exceeds the responses per prompt, rollout.n = {self.rollout.n}",
        )
        check_batch_sizes(self)
        check_placement(self.rollout, self.trainer)
        check_tensor_parallel(self)
        check_lora(self.model.lora, "model.lora")
        check_lora(self.critic.lora, "critic.lora")
        check_adapter_sync(self.model.lora, self.rollout.engine.value, self.rollout.sleep_level)
        check_sync_gap(self.rollout, a.off_policy_correction)
        check_async(self.rollout, self.data.batch_size, self.trainer.total_steps)
        check_router_replay_setup(a.router_replay, self.rollout, self.actor.sequence_parallel_size)
        check_expert_parallel_setup(self)
        if self.distill.enabled:
            check_served(self.distill, "distill", self.trainer)
            require(
                self.distill.objective.value != "topk_forward_kl"
                or self.actor.sequence_parallel_size == 1,
                "distill.objective",
                "topk_forward_kl does not work with sequence parallelism yet "
                "(actor.sequence_parallel_size > 1): use advantage, k1 or k3",
            )
        if self.reward.judge.enabled:
            check_served(self.reward.judge, "reward.judge", self.trainer)
        require(
            self.rollout.agent != "multi_turn" or bool(self.agent.env),
            "agent.env",
            "rollout.agent=multi_turn needs an environment: a registered name "
            "(calculator, guess_number) "
            "or pkg.module:factory / path/to/file.py:factory",
        )
        if a.loss_agg_norm == 0:
            a.loss_agg_norm = self.rollout.max_tokens
        validates = self.trainer.val_every > 0 or self.trainer.val_before_train
        require(
            not validates
            or bool(self.data.val_files)
            or (not self.data.train_files and self.data.val_size > 0),
            "data.val_files",
            "validation is on (trainer.val_every / trainer.val_before_train) but there are no "
            "validation prompts: set data.val_files (a held-out split, data.val_size, exists "
            "only for synthetic tasks)",
        )
        if self.critic.enable is None:
            self.critic.enable = self.algorithm.advantage in NEEDS_CRITIC
        require(
            self.critic.enable or self.algorithm.advantage not in NEEDS_CRITIC,
            "critic.enable",
            f"algorithm.advantage={self.algorithm.advantage} needs a critic; "
            "set critic.enable=true (or null)",
        )
        require(
            self.critic.enable or self.critic.sequence_parallel_size == 1,
            "critic.sequence_parallel_size",
            f"has no effect without a critic (critic.enable=false, algorithm.advantage="
            f"{self.algorithm.advantage}), got {self.critic.sequence_parallel_size}; leave it 1",
        )


def check_expert_parallel_setup(cfg: Config) -> None:
    """What ``actor.expert_parallel_size`` and ``critic.expert_parallel_size`` > 1 do not
    combine with yet (docs/moe.md)."""
    ep = cfg.critic.expert_parallel_size
    critic = cfg.critic.enable
    require(
        ep == 1 or (critic if critic is not None else cfg.algorithm.advantage in NEEDS_CRITIC),
        "critic.expert_parallel_size",
        f"has no effect without a critic (critic.enable=false, algorithm.advantage="
        f"{cfg.algorithm.advantage}), got {ep}; leave it 1",
    )
    for key, size, lora, sp in (
        (
            "actor.expert_parallel_size",
            cfg.actor.expert_parallel_size,
            ("LoRA (model.lora.rank > 0)", cfg.model.lora.enabled),
            ("sequence parallelism", cfg.actor.sequence_parallel_size > 1),
        ),
        (
            "critic.expert_parallel_size",
            cfg.critic.expert_parallel_size,
            ("LoRA (critic.lora.rank > 0)", cfg.critic.lora.enabled),
            ("sequence parallelism", cfg.critic.sequence_parallel_size > 1),
        ),
    ):
        for what, on in (lora, sp):
            require(
                size == 1 or not on,
                key,
                f"{size} does not work with {what} yet: set it 1, or turn that off",
            )


def check_tensor_parallel(cfg: Config) -> None:
    """A TP group is consecutive ranks on one node of the engines' pool (see
    :func:`rlframe.config.placement.check_placement`); only vLLM shards, and spreads experts
    (``rollout.expert_parallel``) over a group of two or more."""
    tp = cfg.rollout.tensor_parallel_size
    require(
        tp == 1 or cfg.rollout.engine.value == "vllm",
        "rollout.tensor_parallel_size",
        f"{tp} > 1 needs rollout.engine=vllm (the hf engine is not sharded)",
    )
    require(
        not cfg.rollout.expert_parallel or (tp >= 2 and cfg.rollout.engine.value == "vllm"),
        "rollout.expert_parallel",
        f"spreads the experts over an engine's ranks: it needs rollout.engine=vllm and "
        f"rollout.tensor_parallel_size >= 2 (got {cfg.rollout.engine.value}, {tp})",
    )


def check_batch_sizes(cfg: Config) -> None:
    """Mini- and micro-batches must tile a step's responses exactly on every rank.

    Padding is fine for generation but not for updates: a padded response would be trained
    on twice. So the step's responses split into whole mini-batches, each mini-batch splits
    evenly across ranks, and each rank's share splits into whole micro-batches.
    """
    responses = cfg.data.batch_size * cfg.rollout.n
    world = cfg.trainer.world_size
    mini, micro = cfg.actor.mini_batch_size, cfg.actor.micro_batch_size
    require(
        responses % mini == 0,
        "actor.mini_batch_size",
        f"{mini} must divide the responses per step, data.batch_size * rollout.n = "
        f"{cfg.data.batch_size} * {cfg.rollout.n} = {responses}",
    )
    require(
        mini % world == 0,
        "actor.mini_batch_size",
        f"{mini} must be a multiple of the number of ranks, trainer.nnodes * "
        f"trainer.procs_per_node = {world}",
    )
    for key, size, mesh in (
        ("actor.sequence_parallel_size", cfg.actor.sequence_parallel_size, "data x sequence"),
        ("critic.sequence_parallel_size", cfg.critic.sequence_parallel_size, "data x sequence"),
        ("actor.expert_parallel_size", cfg.actor.expert_parallel_size, "replica x expert"),
        ("critic.expert_parallel_size", cfg.critic.expert_parallel_size, "replica x expert"),
    ):
        require(
            world % size == 0,
            key,
            f"{size} must divide the number of ranks, trainer.nnodes * trainer.procs_per_node "
            f"= {world} (the ranks form a {mesh} mesh)",
        )
    budget = cfg.actor.max_tokens_per_micro_batch
    if budget > 0:
        # Micro-batches are cut by tokens: micro_batch_size is not used. The budget is a
        # rank's share of a sequence-parallel group's micro-batch.
        longest = cfg.data.max_prompt_length + cfg.rollout.max_tokens
        sp = cfg.actor.sequence_parallel_size
        require(
            budget * sp >= longest,
            "actor.max_tokens_per_micro_batch",
            f"{budget} cannot hold the longest row, "
            f"data.max_prompt_length + rollout.max_tokens = {longest}"
            + (f" (over actor.sequence_parallel_size = {sp} ranks)" if sp > 1 else ""),
        )
        return
    require(
        (mini // world) % micro == 0,
        "actor.micro_batch_size",
        f"{micro} must divide each rank's share of a mini-batch, actor.mini_batch_size / ranks "
        f"= {mini} / {world} = {mini // world}",
    )


def build_config(tree: DictConfig | dict[str, Any]) -> Config:
    """Turn a composed config tree into a validated :class:`Config`.

    Raises:
        ConfigError: for an unknown key, a wrong type, a missing value or an invalid value,
            with the full key in the message.
    """
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    raw = OmegaConf.to_container(tree, resolve=False) if isinstance(tree, DictConfig) else tree
    for key in list_dotted_keys(raw):
        check_renamed_key(key)
    register_now_resolver()
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), tree)
        check_finite_numbers(Config, OmegaConf.to_container(merged, resolve=False), "")
        cfg = OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        cause = e.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        key = getattr(e, "full_key", None) or "config"
        if isinstance(e, MissingMandatoryValue):
            raise ConfigError(
                key, "has no value: set it with key=value or pick a recipe (+recipe=NAME)"
            ) from None
        raise ConfigError(key, first_line(e)) from None
    assert isinstance(cfg, Config)
    return cfg


def check_finite_numbers(owner: type, values: Any, prefix: str) -> None:
    """Every float key of the schema holds a finite number: ``inf`` and ``nan`` parse as
    floats, pass a check such as ``>= 0`` (inf) or fail it with a misleading message (nan),
    and then turn every loss and gradient into NaN. Free-form mappings (``agent.env_kwargs``)
    are the user's and are not looked into."""
    hints = get_type_hints(owner)
    for f in fields(owner):
        value = values.get(f.name) if isinstance(values, dict) else None
        hint = hints[f.name]
        if is_dataclass(hint) and isinstance(hint, type):
            check_finite_numbers(hint, value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}{f.name}", f"must be a finite number, got {value}")


def register_now_resolver() -> None:
    """``${now:...}`` (the default ``trainer.output_dir``) for trees composed outside Hydra;
    Hydra registers the same resolver itself."""
    if OmegaConf.has_resolver("now"):
        return
    from datetime import datetime

    OmegaConf.register_new_resolver("now", lambda pattern: datetime.now().strftime(pattern))
