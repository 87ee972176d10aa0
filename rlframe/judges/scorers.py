"""The built-in judge scorers and verdict parsers (see :mod:`rlframe.judges.client`).

- ``verdict``: the judge generates a verdict for each response; ``reward.judge.parser``
  reads its score (``number``: the last number; ``label``: the last verdict label).
- ``expected``: no generation. The judge's next-token distribution after the filled
  template, over the verdict tokens (``reward.judge.verdicts``): the score is
  ``sum p(v) value(v) / sum p(v)``, over the verdict tokens among the judge's
  ``MAX_TOP_K`` most likely next tokens (the engines report no more; a verdict token
  outside them counts with probability 0; none among them is a parse failure).
- ``listwise``: one call per group: the judge ranks the numbered responses, best first;
  the response ranked ``r`` (0 = best) of ``n`` scores ``(n - 1 - r) / (n - 1)``.
"""

from __future__ import annotations

import asyncio
import math
import re

from rlframe.judges.client import (
    JUDGE_PARSERS,
    JUDGE_SCORERS,
    JudgeClient,
    JudgedGroup,
    JudgeParseError,
)

POINTWISE_TEMPLATE = (
    "Rate the response to the question below from 1 (wrong or useless) to 9 (correct and "
    "excellent).\n\nQuestion:\n{prompt}\n\nReference answer (may be empty):\n{ground_truth}"
    "\n\nResponse:\n{response}\n\n"
)
VERDICT_TEMPLATE = POINTWISE_TEMPLATE + "Explain briefly, then end with the score as one digit."
EXPECTED_TEMPLATE = POINTWISE_TEMPLATE + "Answer with the score only, one digit."
LISTWISE_TEMPLATE = (
    "Here are {n} responses to the question below. Rank them from best to worst.\n\n"
    "Question:\n{prompt}\n\nReference answer (may be empty):\n{ground_truth}\n\n{responses}\n\n"
    "End with the ranking on its own line: the responses' numbers, best first, separated by "
    "commas."
)
DEFAULT_TEMPLATES = {
    "verdict": VERDICT_TEMPLATE,
    "expected": EXPECTED_TEMPLATE,
    "listwise": LISTWISE_TEMPLATE,
}
"""The template of each built-in scorer when ``reward.judge.template`` is null."""
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def pick_template(judge: JudgeClient, scorer: str) -> str:
    return judge.config.template or DEFAULT_TEMPLATES[scorer]


@JUDGE_PARSERS.register("number")
def parse_number(text: str, verdicts: dict[str, float]) -> float:
    """The last number in the verdict (``... so the score is 7.``)."""
    found = NUMBER.findall(text)
    if not found:
        raise JudgeParseError(f"no number in the judge's verdict {text[-200:]!r}")
    return float(found[-1])


@JUDGE_PARSERS.register("label")
def parse_label(text: str, verdicts: dict[str, float]) -> float:
    """The value of the verdict label that comes last in the text (``... Verdict: yes``)."""
    positions = {label: text.rfind(label) for label in verdicts}
    found = [(at, label) for label, at in positions.items() if at >= 0]
    if not found:
        raise JudgeParseError(
            f"none of the labels {sorted(verdicts)} in the judge's verdict {text[-200:]!r}"
        )
    # The last label wins; of two ending at the same place ("yes" in "not yes"), the longer.
    at, label = max(found, key=lambda f: (f[0] + len(f[1]), len(f[1])))
    return verdicts[label]


def read_expected_value(
    top: dict[int, float], verdict_ids: dict[str, int], verdicts: dict[str, float]
) -> float:
    """``sum p(v) value(v) / sum p(v)`` over the verdict tokens in ``top`` (id -> log-prob)."""
    weights = {label: math.exp(top[i]) for label, i in verdict_ids.items() if i in top}
    total = sum(weights.values())
    if total <= 0:
        raise JudgeParseError(
            f"none of the verdict tokens {sorted(verdicts)} is among the judge's most likely "
            "next tokens"
        )
    return sum(w * verdicts[label] for label, w in weights.items()) / total


@JUDGE_SCORERS.register("verdict")
async def score_by_verdict(group: JudgedGroup, judge: JudgeClient) -> list[float | BaseException]:
    """One generated verdict per response, read by ``reward.judge.parser``."""
    parse = JUDGE_PARSERS.get(judge.config.parser)
    template = pick_template(judge, "verdict")

    async def score(response: str) -> float:
        text = judge.render(
            template, prompt=group.prompt, response=response, ground_truth=group.ground_truth
        )
        return parse(await judge.generate(text), judge.config.verdicts)

    return await asyncio.gather(*(score(r) for r in group.responses), return_exceptions=True)


@JUDGE_SCORERS.register("expected")
async def score_by_expected_value(
    group: JudgedGroup, judge: JudgeClient
) -> list[float | BaseException]:
    """The expected value of the verdict tokens under the judge's next-token distribution."""
    template = pick_template(judge, "expected")

    async def score(response: str) -> float:
        text = judge.render(
            template, prompt=group.prompt, response=response, ground_truth=group.ground_truth
        )
        top = await judge.read_next_token(text)
        return read_expected_value(top, judge.verdict_ids, judge.config.verdicts)

    return await asyncio.gather(*(score(r) for r in group.responses), return_exceptions=True)


def number_responses(responses: list[str]) -> str:
    return "\n".join(f"({i}) {r}" for i, r in enumerate(responses, 1))


def parse_ranking(text: str, n: int) -> list[float]:
    """Scores from a ranking of ``n`` responses (``3, 1, 2``: best first) on the verdict's
    last line that holds numbers: the response ranked ``r`` scores ``(n - 1 - r) / (n - 1)``.
    A line that is not a permutation of 1..n is a parse failure."""
    lines = [line for line in text.splitlines() if re.search(r"\d", line)]
    order = [int(x) for x in re.findall(r"\d+", lines[-1])] if lines else []
    if sorted(order) != list(range(1, n + 1)):
        raise JudgeParseError(
            f"the judge's ranking {lines[-1] if lines else text[-200:]!r} is not an order of "
            f"the {n} responses (each of 1..{n} once)"
        )
    scores = [0.0] * n
    for rank, number in enumerate(order):
        scores[number - 1] = (n - 1 - rank) / (n - 1) if n > 1 else 1.0
    return scores


@JUDGE_SCORERS.register("listwise")
async def score_by_ranking(group: JudgedGroup, judge: JudgeClient) -> list[float | BaseException]:
    """One call ranks the whole group; a verdict that is no ranking fails every response."""
    text = judge.render(
        pick_template(judge, "listwise"),
        prompt=group.prompt,
        ground_truth=group.ground_truth,
        responses=number_responses(group.responses),
        n=len(group.responses),
    )
    return list(parse_ranking(await judge.generate(text), len(group.responses)))
