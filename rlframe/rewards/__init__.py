"""Reward functions: a registry of rule rewards plus users' own functions by dotted path.

A reward function scores one response:

    def my_reward(response: str, ground_truth: str, sample: dict) -> float

``sample`` holds the prompt's other columns (``prompt``, ``task``...). Point
``reward.fn`` at ``pkg.module:my_reward`` or ``path/to/file.py:my_reward`` to use your own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from rlframe.algorithms.registry import Registry

RewardFn = Callable[[str, str, dict[str, Any]], float]
REWARDS: Registry[RewardFn] = Registry("reward")


class RewardError(RuntimeError):
    """A reward function raised or returned something that is not a finite number."""


def extract_answer(response: str) -> str:
    """The response up to its first newline, stripped: what the rule rewards compare."""
    return response.split("\n", 1)[0].strip()


@REWARDS.register("exact_match")
def score_exact_match(response: str, ground_truth: str, sample: dict[str, Any]) -> float:
    """1 if the answer equals the ground truth exactly, else 0."""
    return float(extract_answer(response) == ground_truth)


@REWARDS.register("char_match")
def score_char_match(response: str, ground_truth: str, sample: dict[str, Any]) -> float:
    """Share of positions where answer and ground truth agree, over the longer length.

    1 for an exact answer; partial credit makes the signal dense enough for a tiny model
    that starts from random weights (a right first digit, the right length...).
    """
    answer = extract_answer(response)
    longest = max(len(answer), len(ground_truth))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(answer, ground_truth)) / longest


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_final_number(text: str) -> str | None:
    """The answer a math response commits to: after '####', else in \\boxed{}, else the last number."""
    for pattern in (r"####\s*([^\n]+)", r"\\boxed\{([^}]*)\}"):
        found = re.findall(pattern, text)
        if found:
            text = found[-1]
            break
    numbers = NUMBER.findall(text)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


@REWARDS.register("math_answer")
def score_math_answer(response: str, ground_truth: str, sample: dict[str, Any]) -> float:
    """1 if the response's final number equals the ground truth's (GSM8K-style), else 0."""
    answer, truth = extract_final_number(response), extract_final_number(ground_truth)
    if answer is None or truth is None:
        return 0.0
    try:
        return float(abs(float(answer) - float(truth)) < 1e-6)
    except ValueError:
        return 0.0


def compute_rewards(
    fn: RewardFn, fn_name: str, responses: Sequence[str], ground_truths: Sequence[str], samples: Sequence[dict[str, Any]]
) -> list[float]:
    """Score every response; a failure names the function and the sample."""
    import math

    scores = []
    for i, (response, truth, sample) in enumerate(zip(responses, ground_truths, samples, strict=True)):
        try:
            score = float(fn(response, truth, sample))
        except Exception as e:
            raise RewardError(
                f"reward function {fn_name} raised {type(e).__name__}: {e} on sample {i} "
                f"(prompt {sample.get('prompt')!r}, response {response!r}, ground truth {truth!r})"
            ) from e
        if not math.isfinite(score):
            raise RewardError(f"reward function {fn_name} returned {score} on sample {i} (response {response!r})")
        scores.append(score)
    return scores
