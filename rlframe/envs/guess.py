"""Guess the number: a multi-turn game with higher/lower feedback (``agent.env=guess_number``).

The secret is the sample's ground truth; the prompt does not show it, so one guess finds it
one time in (high - low + 1): the model has to read the feedback and try again. A right
guess ends the episode with reward 1.
"""

from __future__ import annotations

import re
from typing import Any

from rlframe.envs.base import ENVS, Message, StepResult, default_messages

LEADING_INTEGER = re.compile(r"\s*(-?\d+)")


def parse_guess(action: str) -> int | None:
    """The integer the turn starts with, or None."""
    match = LEADING_INTEGER.match(action)
    return int(match.group(1)) if match else None


@ENVS.register("guess_number")
class GuessNumberEnv:
    """Args:
    hint_format: the feedback message, formatted with ``hint`` = higher, lower or invalid
        (``higher``: the secret is above the guess). Chat models read a sentence; the
        tiny character-level model reads ``" {hint}:"``.
    correct_reward: reward of the right guess.
    """

    def __init__(
        self,
        hint_format: str = "Wrong: the number is {hint}. Guess again.",
        correct_reward: float = 1.0,
    ) -> None:
        self.hint_format = hint_format
        self.correct_reward = correct_reward
        self.secret = 0

    def reset(self, sample: dict[str, Any]) -> list[Message]:
        self.secret = int(sample["ground_truth"])
        return default_messages(sample)

    def step(self, action: str) -> StepResult:
        guess = parse_guess(action)
        if guess == self.secret:
            return StepResult([], self.correct_reward, True, {})
        hint = "invalid" if guess is None else ("higher" if self.secret > guess else "lower")
        return StepResult(
            [{"role": "user", "content": self.hint_format.format(hint=hint)}], 0.0, False, {}
        )
