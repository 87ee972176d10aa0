"""The judge stage, run by the reward stage (:class:`rlframe.rewards.stage.RewardStage`):
every group of a scored batch judged at once.

The groups' scorers run as coroutines on one event loop, in a driver thread of this stage,
while the rule reward scores in its processes; the judge's engines batch their requests
(continuous batching across every group in flight). Per row it gives ``judge_score`` and
which rows failed and how: a parse failure, a timeout, an engine (or scorer) error. Under
``reward.judge.on_error=raise`` the first failure stops the run (:class:`JudgeError`, one
line); under ``mask`` the reward stage takes failed rows out of training
(:func:`rlframe.rewards.stage.mask_failed_samples`). A failed row's ``judge_score`` is 0 and
is not a score.

Metrics (:meth:`JudgeStage.take_metrics`, per step): ``judge/calls``, ``judge/tokens``,
``judge/s`` (the stage's wall time), ``judge/parse_failures``, ``judge/timeouts``,
``judge/errors`` (counts of the failures that stand), ``judge/score_mean`` and
``judge/score_std`` over the rows scored; with ``reward.retry_on_error``, ``judge/retries``
(rows judged a second time).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from rlframe.config.checks import ConfigError, first_line
from rlframe.config.judge import JUDGE_FAILURES, JudgeConfig
from rlframe.core.protocol import Batch
from rlframe.judges import scorers
from rlframe.judges.client import (
    JUDGE_SCORERS,
    JudgeClient,
    JudgedGroup,
    JudgeError,
    JudgeParseError,
)
from rlframe.rewards.stage import JudgedRows

FAILURE_KINDS = JUDGE_FAILURES


def classify_failure(error: BaseException) -> str:
    if isinstance(error, JudgeParseError):
        return "parse_failures"
    if isinstance(error, TimeoutError):
        return "timeouts"
    return "errors"


@dataclass
class JudgeScores:
    """One judged batch, per row."""

    scores: list[float]
    """0 where the row failed."""
    failures: list[str | None]
    """None, or the kind of failure (one of ``FAILURE_KINDS``)."""
    reasons: list[str] = field(default_factory=list)
    """Each failure's one-line reason ('' for a scored row)."""

    def flags(self, kind: str) -> torch.Tensor:
        return torch.tensor([f == kind for f in self.failures], dtype=torch.float32)


class JudgeStage:
    """Args:
    client: the judge's client.
        sleep: puts a colocated judge to sleep (:meth:`release`, after the step's judging);
        None for a judge that stays awake (its own pool).
        wake: wakes it again before it judges (the stream's ``open``).
        retry: judge once more each group with a failed row (``reward.retry_on_error``): a
            failed row takes its second outcome, the others keep their first.
    """

    def __init__(
        self,
        client: JudgeClient,
        sleep: Callable[[], None] | None = None,
        wake: Callable[[], None] | None = None,
        retry: bool = False,
    ) -> None:
        cfg = client.config
        self.client, self.sleep, self.wake, self.cfg = client, sleep, wake, cfg
        self.scorer = JUDGE_SCORERS.get(cfg.scorer)
        check_template(cfg)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="judge")
        self.asleep = False
        self.seconds = 0.0
        self.retry = retry
        self.failed = dict.fromkeys(FAILURE_KINDS, 0)
        self.retried = 0
        self.scored: list[float] = []

    def start(self, batch: Batch, responses: list[str]) -> Future[JudgedRows]:
        """Judge every group of ``batch`` (rows with the same ``group``) in the background:
        its :class:`JudgeScores`."""
        return self.thread.submit(self.judge, batch, responses)

    def judge(self, batch: Batch, responses: list[str]) -> JudgeScores:
        started = time.perf_counter()
        if self.asleep and self.wake is not None:
            self.wake()  # a colocated judge slept while the policy trained
            self.asleep = False
        rows = split_groups(batch.tensor("group").tolist())
        groups = [
            JudgedGroup(
                batch.column("prompt")[idx[0]],
                [responses[i] for i in idx],
                batch.column("ground_truth")[idx[0]],
                dict(batch.column("extra")[idx[0]])
                | {"messages": batch.column("messages")[idx[0]]},
            )
            for idx in rows
        ]
        outcomes = asyncio.run(self.judge_groups(groups))
        if self.retry:
            outcomes = self.judge_again(groups, outcomes)
        scores: list[float] = [0.0] * len(batch)
        failures: list[str | None] = [None] * len(batch)
        reasons = [""] * len(batch)
        for idx, got in zip(rows, outcomes, strict=True):
            for i, value in zip(idx, got, strict=True):
                if isinstance(value, BaseException):
                    failures[i], reasons[i] = classify_failure(value), first_line(value)
                else:
                    scores[i] = value
        self.seconds += time.perf_counter() - started
        for kind in failures:
            if kind is not None:
                self.failed[kind] += 1
        self.scored += [s for s, f in zip(scores, failures, strict=True) if f is None]
        judged = JudgeScores(scores, failures, reasons)
        if self.cfg.on_error == "raise":
            raise_first_failure(judged, batch, responses, self.cfg.scorer)
        return judged

    def judge_again(
        self, groups: list[JudgedGroup], outcomes: list[list[float | BaseException]]
    ) -> list[list[float | BaseException]]:
        """Each group with a failed row judged once more (whole: a listwise scorer ranks the
        group in one call); a failed row takes its second outcome, the others keep the first."""
        again = [k for k, got in enumerate(outcomes) if any(is_failure(v) for v in got)]
        if not again:
            return outcomes
        second = asyncio.run(self.judge_groups([groups[k] for k in again]))
        merged = list(outcomes)
        for k, got in zip(again, second, strict=True):
            self.retried += sum(is_failure(v) for v in outcomes[k])
            merged[k] = [
                new if is_failure(old) else old for old, new in zip(outcomes[k], got, strict=True)
            ]
        return merged

    async def judge_groups(self, groups: list[JudgedGroup]) -> list[list[float | BaseException]]:
        return list(await asyncio.gather(*(self.judge_group(g) for g in groups)))

    async def judge_group(self, group: JudgedGroup) -> list[float | BaseException]:
        """The scorer's answer for ``group``, checked: one finite number (or an exception)
        per response; a scorer that raises fails the whole group."""
        n = len(group.responses)
        try:
            got = list(await self.scorer(group, self.client))
        except Exception as e:  # a user's scorer may raise anything
            return [e] * n
        if len(got) != n:
            wrong = RuntimeError(
                f"judge scorer {self.cfg.scorer} returned {len(got)} scores for {n} responses"
            )
            return [wrong] * n
        return [check_score(v) for v in got]

    def take_metrics(self) -> dict[str, float]:
        """The ``judge/*`` figures since the last call (see the module docstring)."""
        counters = self.client.take_counters()
        metrics = {
            "judge/calls": float(counters.calls),
            "judge/tokens": float(counters.tokens),
            "judge/s": self.seconds,
        } | {f"judge/{kind}": float(count) for kind, count in self.failed.items()}
        if self.retry:
            metrics["judge/retries"] = float(self.retried)
        if self.scored:
            scored = torch.tensor(self.scored, dtype=torch.float64)
            metrics["judge/score_mean"] = float(scored.mean())
            metrics["judge/score_std"] = float(scored.std(unbiased=False))
        self.seconds, self.failed, self.scored = 0.0, dict.fromkeys(FAILURE_KINDS, 0), []
        self.retried = 0
        return metrics

    def release(self) -> None:
        """After the step's judging: a colocated judge sleeps while the policy trains."""
        if self.sleep is not None and not self.asleep:
            self.sleep()
            self.asleep = True

    def close(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)


def is_failure(value: float | BaseException) -> bool:
    return isinstance(value, BaseException)


def check_score(value: object) -> float | BaseException:
    if isinstance(value, BaseException):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return RuntimeError(f"the judge scorer returned {value!r}, not a finite number")
    return float(value)


def split_groups(group_ids: list[int]) -> list[list[int]]:
    """Row indices of each group, in order of first appearance."""
    rows: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        rows.setdefault(int(g), []).append(i)
    return list(rows.values())


def check_template(cfg: JudgeConfig) -> None:
    """A custom template names only fields the built-in scorers fill."""
    if cfg.template is None or cfg.scorer not in scorers.DEFAULT_TEMPLATES:
        return
    fields = {"prompt": "", "response": "", "ground_truth": "", "responses": "", "n": 0}
    try:
        cfg.template.format(**fields)
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(
            "reward.judge.template",
            f"{first_line(e)!s}: its fields are {{prompt}}, {{response}}, {{ground_truth}} "
            "(listwise: {responses}, {n}); write a literal brace as {{ or }}",
        ) from None


def raise_first_failure(
    judged: JudgeScores, batch: Batch, responses: list[str], scorer: str
) -> None:
    """``reward.judge.on_error=raise``: the first failed row stops the run, in one line."""
    for i, kind in enumerate(judged.failures):
        if kind is None:
            continue
        what = {"parse_failures": "parse failure", "timeouts": "timeout", "errors": "error"}[kind]
        raise JudgeError(
            f"the judge ({scorer}) failed on sample {i} ({what}: {judged.reasons[i]}; prompt "
            f"{batch.column('prompt')[i]!r}, response {responses[i]!r}); "
            "reward.judge.on_error=mask leaves such samples out of training and counts them "
            "instead"
        )
