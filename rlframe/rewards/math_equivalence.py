"""``math_verify``: symbolic answer checking with the ``math-verify`` package.

The ground truth (``72``, ``\\frac{1}{2}``, ``x^2+1``, ``#### 72``) is compared with the
answer the response commits to (``\\boxed{}`` first, then a final LaTeX or plain
expression), as sympy expressions: ``0.5``, ``\\frac12`` and ``1/2`` are the same answer.
"""

from __future__ import annotations

import threading
from typing import Any, cast

from rlframe.rewards.registry import REWARDS


def parse_gold(ground_truth: str, timeout: int | None) -> list[Any]:
    """The ground truth as math-verify's parsed forms; GSM8K's ``#### N`` is reduced to N."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    text = ground_truth.split("####")[-1].strip()
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold = parse(f"\\boxed{{{text}}}", configs, parsing_timeout=timeout)
    # math-verify ships no annotations; parse() returns a list of the parsed forms.
    return cast(list[Any], gold or parse(text, configs, parsing_timeout=timeout))


@REWARDS.register("math_verify")
def score_math_verify(response: str, ground_truth: str, sample: dict[str, Any]) -> float:
    """1 if the response's final answer equals the ground truth mathematically, else 0."""
    from math_verify import parse, verify

    # math-verify times itself out with signal.alarm, which only the main thread may use.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse_gold(ground_truth, timeout)
    if not gold:
        raise ValueError(f"math_verify cannot parse the ground truth {ground_truth!r}")
    answer = parse(response, parsing_timeout=timeout)
    return float(bool(answer) and verify(gold, answer, timeout_seconds=timeout))
