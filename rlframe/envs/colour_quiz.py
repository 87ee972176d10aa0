"""Colour quiz: two questions about two images (``agent.env=colour_quiz``), for a
vision-language model on the ``colour`` task (:mod:`rlframe.data.visual_tasks`).

Turn 1 answers the prompt row's question about its image (the answer is the row's ground
truth); the observation then shows a second square, drawn from the first image's bytes (the
same row always gets the same one), and asks again; turn 2 answers that. Each right answer
(the colour's initial first in the turn) earns ``answer_reward``. Offline and cheap: it makes
a multi-turn episode whose observation carries an image, end to end on the CPU.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

from rlframe.data.visual_tasks import COLOUR_PROMPT, COLOURS, draw_square
from rlframe.envs.base import ENVS, Message, StepResult, default_messages


@ENVS.register("colour_quiz")
class ColourQuizEnv:
    """Args:
    question: the text after the second image.
    answer_reward: reward of each right answer (an episode earns at most twice it).
    """

    def __init__(self, question: str = COLOUR_PROMPT, answer_reward: float = 0.5) -> None:
        self.question = question
        self.answer_reward = answer_reward
        self.answers: list[str] = []
        self.second = b""

    def reset(self, sample: dict[str, Any]) -> list[Message]:
        images = sample.get("images") or []
        seed = zlib.crc32(images[0]) if images else zlib.crc32(str(sample["prompt"]).encode())
        rng = random.Random(seed)
        name = rng.choice(sorted(COLOURS))
        self.second = draw_square(rng, COLOURS[name])
        self.answers = [str(sample["ground_truth"]), name[0]]
        return default_messages(sample)

    def step(self, action: str) -> StepResult:
        answer = self.answers.pop(0)
        reward = self.answer_reward if action.strip().startswith(answer) else 0.0
        if not self.answers:
            return StepResult([], reward, True, {})
        parts = [{"type": "image", "image": self.second}, {"type": "text", "text": self.question}]
        return StepResult([{"role": "user", "content": parts}], reward, False, {})
