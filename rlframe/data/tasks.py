"""Synthetic verifiable tasks, generated from a seed (offline stand-ins for GSM8K).

Each task turns a random generator into (prompt, ground truth) pairs whose answers a rule
can check. Prompts end in ``=`` and answers are short, so a tiny model can learn them by
RL on a CPU within minutes. Rewards for these tasks live in :mod:`rlframe.rewards`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

LETTERS = "abcde"


@dataclass(frozen=True)
class Example:
    prompt: str
    ground_truth: str
    task: str
    images: list[bytes] = field(default_factory=list)
    """A visual task's images (PNG bytes), which the prompt is about."""


def make_arithmetic(rng: random.Random) -> tuple[str, str]:
    # Operands up to 4 keep every answer one digit. With two-digit sums a policy that
    # starts from random weights first learns to open every answer with "1" (right for
    # 45% of 0-9 sums) and collapses there before it learns to add.
    a, b = rng.randint(0, 4), rng.randint(0, 4)
    return f"{a}+{b}=", str(a + b)


def make_copy(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 4)))
    return f"copy {word}=", word


def make_reverse(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 4)))
    return f"reverse {word}=", word[::-1]


def make_count(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
    return f"count a {word}=", str(word.count("a"))


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "arithmetic": make_arithmetic,
    "copy": make_copy,
    "reverse": make_reverse,
    "count": make_count,
}
GUESS_HIGH = 9


def make_guess(rng: random.Random) -> tuple[str, str]:
    # The secret is only the ground truth: the prompt is the same for every secret, so the
    # model must use the env's higher/lower feedback (rollout.agent=multi_turn,
    # agent.env=guess_number).
    return f"guess 0-{GUESS_HIGH}:", str(rng.randint(0, GUESS_HIGH))


ENV_TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {"guess": make_guess}
"""Tasks scored by an environment rather than a rule; not part of ``mixed``."""
VISUAL_TASKS = ("colour",)
"""Tasks whose prompts carry an image (:mod:`rlframe.data.visual_tasks`); for a
vision-language model, not part of ``mixed``."""
GENERATED_TASKS = (*TASKS, "mixed", *ENV_TASKS, *VISUAL_TASKS)
"""Every task this module generates: the schema's ``TASK_NAMES``."""
"""What ``data.task`` accepts: each task, ``mixed`` (the rule-scored ones in turn), an env
task, or a visual task."""


def generate_examples(task: str, count: int, seed: int) -> list[Example]:
    """``count`` examples of ``task`` (or ``mixed``: all tasks in turn), fixed by ``seed``."""
    if task not in GENERATED_TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; choose from {list(GENERATED_TASKS)}")
    rng = random.Random(seed)
    if task in VISUAL_TASKS:
        from rlframe.data.visual_tasks import make_colour

        return [
            Example(prompt, answer, task, images)
            for prompt, answer, images in (make_colour(rng) for _ in range(count))
        ]
    names = list(TASKS) if task == "mixed" else [task]
    makers = TASKS | ENV_TASKS
    examples = []
    for i in range(count):
        name = names[i % len(names)]
        prompt, answer = makers[name](rng)
        examples.append(Example(prompt, answer, name))
    return examples
