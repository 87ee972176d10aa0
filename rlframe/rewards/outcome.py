"""Scoring one sample with a rule reward: a finite score, or why there is none. Shared by
the driver's scorer (:mod:`rlframe.rewards.scoring`) and the pool's processes
(:mod:`rlframe.rewards.pool`, :mod:`rlframe.rewards.pool_worker`)."""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass
from typing import Any

from rlframe.rewards.registry import RewardFn


@dataclass
class Outcome:
    """What scoring one sample gave: a finite score, or why there is none."""

    score: float | None
    error: str | None = None
    """``raised ValueError: ...``, ``returned 'x' (str), not a number``, ``returned nan``..."""
    timed_out: bool = False


def check_value(value: Any) -> Outcome:
    """A reward's return value as an Outcome: numbers (bool, int, float, numpy or torch
    scalars) that are finite are scores; anything else is a failure."""
    if isinstance(value, str | bytes) or not hasattr(value, "__float__"):
        return Outcome(None, f"returned {value!r:.80} ({type(value).__name__}), not a number")
    try:
        score = float(value)
    except (TypeError, ValueError) as e:  # a tensor with several elements, say
        return Outcome(None, f"returned {type(value).__name__} that is not one number: {e}")
    if not math.isfinite(score):
        return Outcome(None, f"returned {score}")
    return Outcome(score)


def call_reward(fn: RewardFn, response: str, ground_truth: str, sample: dict[str, Any]) -> Outcome:
    """Run one reward function on one sample; whatever it raises becomes the Outcome's error."""
    try:
        value = fn(response, ground_truth, sample)
    except Exception as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        return Outcome(None, f"raised {type(e).__name__}: {e} (at {where.filename}:{where.lineno})")
    return check_value(value)
