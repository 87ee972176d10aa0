"""The config schema: typed dataclasses, the one source of config truth.

Recipes in ``recipes/`` and command-line overrides only change values of this schema.
Hydra/OmegaConf enforce key names and types while composing; ``build_config`` then turns
the composed tree into these plain dataclasses and runs the value and cross-field checks in
``__post_init__``. Every check raises :class:`ConfigError` naming the full key and what is
allowed, so a bad run stops before Ray starts. Workers receive these dataclasses, never a
DictConfig.

The schema is split by topic: :mod:`~rlframe.config.model`, :mod:`~rlframe.config.rollout`,
:mod:`~rlframe.config.sections` (data, actor, critic, trainer, val, ray),
:mod:`~rlframe.config.reward`, :mod:`~rlframe.config.algorithm`, :mod:`~rlframe.config.agent`
(multi-turn episodes), and :mod:`~rlframe.config.schema` (the root ``Config`` and
``build_config``). Import from here.
"""

from rlframe.config.agent import AgentConfig
from rlframe.config.algorithm import AlgorithmConfig
from rlframe.config.checks import ConfigError, first_line, require, require_choice, require_positive
from rlframe.config.model import ModelConfig
from rlframe.config.reward import RewardConfig, RewardModelConfig
from rlframe.config.rollout import Placement, RolloutConfig, RolloutEngineName, StaleGroups
from rlframe.config.schema import Config, build_config, check_batch_sizes
from rlframe.config.sections import (
    ActorConfig,
    CriticConfig,
    DataConfig,
    Device,
    RayConfig,
    TrainerConfig,
    ValConfig,
)

__all__ = [
    "ActorConfig",
    "AgentConfig",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "Device",
    "ModelConfig",
    "Placement",
    "RayConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RolloutEngineName",
    "StaleGroups",
    "TrainerConfig",
    "ValConfig",
    "build_config",
    "check_batch_sizes",
    "first_line",
    "require",
    "require_choice",
    "require_positive",
]
