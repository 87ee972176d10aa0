"""The reward registry: rule rewards by name, users' own by ``pkg.module:fn`` / ``file.py:fn``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlframe.core.registry import Registry

RewardFn = Callable[[str, str, dict[str, Any]], float]
REWARDS: Registry[RewardFn] = Registry("reward")


class RewardError(RuntimeError):
    """A reward function raised, returned something that is not a finite number, or timed out."""
