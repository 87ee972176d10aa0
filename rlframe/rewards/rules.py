"""Rule rewards for the synthetic tasks and GSM8K-style answers (pure string checks)."""

from __future__ import annotations

import re
from typing import Any

from rlframe.rewards.registry import REWARDS


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
    """The answer a math response commits to: after '####', else in \\boxed{}, else the last
    number."""
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
