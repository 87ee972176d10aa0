"""Scoring responses with a rule reward: in the driver or in a pool of processes, with a
per-sample time limit and a policy for samples whose reward fails.

A sample *fails* when its reward function raises, returns something that is not a number,
returns NaN or infinity, or (in the pool) runs past ``reward.timeout_s`` or kills its
process. With ``reward.retry_on_error`` it is scored once more first. Then
``reward.on_error=raise`` (the default) stops the run with a :class:`RewardError` naming the
function and the sample; ``mask`` and ``zero`` give it score 0 and count it in
``reward/errors`` or ``reward/timeouts`` (under ``mask`` the reward stage then takes the
sample out of training: :func:`rlframe.rewards.stage.mask_failed_samples`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlframe.rewards.outcome import Outcome, call_reward
from rlframe.rewards.pool import RewardPool
from rlframe.rewards.registry import REWARDS, RewardError


@dataclass
class RuleScores:
    """Scores of a batch (0 where a sample failed under ``on_error=zero`` or ``mask``) and
    which failed."""

    scores: list[float]
    errors: list[bool] = field(default_factory=list)
    """Raised, returned a non-number or non-finite value, or its process died."""
    timeouts: list[bool] = field(default_factory=list)
    """Ran past ``reward.timeout_s``."""
    retried: list[bool] = field(default_factory=list)
    """Scored a second time (``reward.retry_on_error``) after a first failure."""


def has_failed(outcome: Outcome) -> bool:
    """Whether the sample was scored and has no score (cancelled samples were not scored)."""
    return outcome.score is None and not outcome.cancelled


def apply_error_policy(
    outcomes: Sequence[Outcome],
    fn_name: str,
    responses: Sequence[str],
    ground_truths: Sequence[str],
    samples: Sequence[dict[str, Any]],
    on_error: str,
) -> RuleScores:
    """Scores from outcomes: the first failure raises (``raise``) or scores 0 (``mask``,
    ``zero``)."""
    scores, errors, timeouts = [], [], []
    failed = [i for i, o in enumerate(outcomes) if has_failed(o)]
    if failed and on_error == "raise":
        i = failed[0]
        hint = (
            "; reward.on_error=mask leaves such samples out of training and counts them "
            "instead (reward.retry_on_error=true scores each once more first)"
        )
        raise RewardError(
            f"reward function {fn_name} {outcomes[i].error} on sample {i} "
            f"(prompt {samples[i].get('prompt')!r}, response {responses[i]!r}, "
            f"ground truth {ground_truths[i]!r}){hint}"
        )
    for outcome in outcomes:
        scores.append(0.0 if outcome.score is None else outcome.score)
        timeouts.append(outcome.timed_out)
        errors.append(outcome.score is None and not outcome.timed_out)
    return RuleScores(scores, errors, timeouts)


if TYPE_CHECKING:
    from rlframe.config import RewardConfig


class RuleScorer:
    """The run's rule reward: ``reward.num_workers`` processes score a batch in parallel with
    ``reward.timeout_s`` per sample; with 0 workers the driver scores it (no time limit).

    The pool starts on first use and lives until :meth:`close`; a worker that hangs or
    dies is killed and replaced, so one bad sample never stalls the next.
    """

    def __init__(self, fn_name: str, cfg: RewardConfig) -> None:
        self.fn_name, self.cfg = fn_name, cfg
        self.fn = REWARDS.get(fn_name)
        self.pool: RewardPool | None = None

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[str],
        samples: Sequence[dict[str, Any]],
    ) -> RuleScores:
        """Every sample's score; with ``reward.retry_on_error`` each sample that failed is
        scored once more (within what is left of ``reward.step_timeout_s``) before
        ``reward.on_error`` decides."""
        stage_end = time.monotonic() + self.cfg.step_timeout_s
        todo = list(range(len(responses)))
        outcomes: list[Outcome] = [Outcome(None, cancelled=True)] * len(responses)
        retried: set[int] = set()
        while todo:
            left = stage_end - time.monotonic()
            if left <= 0:  # no time left to retry in: the failures stand
                break
            got = self.score_once(
                [responses[i] for i in todo],
                [ground_truths[i] for i in todo],
                [samples[i] for i in todo],
                left if retried else self.cfg.step_timeout_s,
            )
            for i, outcome in zip(todo, got, strict=True):
                outcomes[i] = outcome
            if not self.cfg.retry_on_error or any(
                has_failed(outcomes[i]) for i in todo if i in retried
            ):
                break  # a second failure is final: on_error decides
            again = [i for i in todo if has_failed(outcomes[i])]
            retried.update(again)
            # Under on_error=raise the pool cancelled the rest at the first failure.
            todo = sorted(again + [i for i in todo if outcomes[i].cancelled])
            if not again:
                break
        scores = apply_error_policy(
            outcomes, self.fn_name, responses, ground_truths, samples, self.cfg.on_error
        )
        scores.retried = [i in retried for i in range(len(responses))]
        return scores

    def score_once(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[str],
        samples: Sequence[dict[str, Any]],
        deadline_s: float,
    ) -> list[Outcome]:
        """One pass: in the driver (no time limit), or in the pool, each sample under
        ``reward.timeout_s`` and all of them under ``deadline_s``."""
        if self.cfg.num_workers == 0:
            return [
                call_reward(self.fn, r, t, s)
                for r, t, s in zip(responses, ground_truths, samples, strict=True)
            ]
        if self.pool is None:
            self.pool = RewardPool(self.fn_name, self.cfg.num_workers, self.cfg.timeout_s)
        return self.pool.score(
            responses,
            ground_truths,
            samples,
            fail_fast=self.cfg.on_error == "raise",
            deadline_s=deadline_s,
        )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
