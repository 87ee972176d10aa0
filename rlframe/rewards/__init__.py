"""Rewards: a registry of rule rewards plus users' own functions by dotted path.

A reward function scores one response:

    def my_reward(response: str, ground_truth: str, sample: dict) -> float

``sample`` holds the prompt's other columns (``prompt``, ``task``, ``data_source``,
``tests``...). Point ``reward.fn`` at ``pkg.module:my_reward`` or
``path/to/file.py:my_reward`` to use your own.

Built in: ``exact_match``, ``char_match`` and ``math_answer`` (:mod:`.rules`),
``math_verify`` (:mod:`.math_equivalence`), ``code_tests`` (:mod:`.code_tests`, through the
sandbox in :mod:`.sandbox`). :mod:`.scoring` runs them, in parallel processes
(:mod:`.pool`) with a time limit per sample.

A generative judge (``reward.judge``) scores on the driver, through async scorers that get a
:class:`~rlframe.judges.client.JudgeClient` (:mod:`rlframe.judges`).
"""

from __future__ import annotations

from rlframe.rewards import code_tests, math_equivalence  # noqa: F401  (registers their rewards)
from rlframe.rewards.registry import REWARDS, RewardError, RewardFn
from rlframe.rewards.rules import (
    extract_answer,
    extract_final_number,
    score_char_match,
    score_exact_match,
    score_math_answer,
)
from rlframe.rewards.scoring import RuleScorer, RuleScores

__all__ = [
    "REWARDS",
    "RewardError",
    "RewardFn",
    "RuleScorer",
    "RuleScores",
    "extract_answer",
    "extract_final_number",
    "score_char_match",
    "score_exact_match",
    "score_math_answer",
]
