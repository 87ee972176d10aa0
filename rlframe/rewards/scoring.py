"""Scoring responses with a rule reward: in the driver or in a pool of processes, with a
per-sample time limit and a policy for samples whose reward fails.

A sample *fails* when its reward function raises, returns something that is not a number,
returns NaN or infinity, or (in the pool) runs past ``reward.timeout_s`` or kills its
process. ``reward.on_error=raise`` (the default) stops the run with a :class:`RewardError`
naming the function and the sample; ``zero`` scores the sample 0 and counts it in
``reward/errors`` or ``reward/timeouts``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlframe.rewards.outcome import Outcome, call_reward
from rlframe.rewards.pool import RewardPool
from rlframe.rewards.registry import REWARDS, RewardError


@dataclass
class RuleScores:
    """Scores of a batch (0 where a sample failed under ``on_error=zero``) and which failed."""

    scores: list[float]
    errors: list[bool] = field(default_factory=list)
    """Raised, returned a non-number or non-finite value, or its process died."""
    timeouts: list[bool] = field(default_factory=list)
    """Ran past ``reward.timeout_s``."""


def apply_error_policy(
    outcomes: Sequence[Outcome],
    fn_name: str,
    responses: Sequence[str],
    ground_truths: Sequence[str],
    samples: Sequence[dict[str, Any]],
    on_error: str,
) -> RuleScores:
    """Scores from outcomes: the first failure raises (``raise``) or scores 0 (``zero``)."""
    scores, errors, timeouts = [], [], []
    for i, outcome in enumerate(outcomes):
        if outcome.score is None and on_error == "raise":
            hint = "; reward.on_error=zero scores such samples 0 and counts them instead"
            raise RewardError(
                f"reward function {fn_name} {outcome.error} on sample {i} "
                f"(prompt {samples[i].get('prompt')!r}, response {responses[i]!r}, "
                f"ground truth {ground_truths[i]!r}){hint}"
            )
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
        if self.cfg.num_workers == 0:
            outcomes = [
                call_reward(self.fn, r, t, s)
                for r, t, s in zip(responses, ground_truths, samples, strict=True)
            ]
        else:
            if self.pool is None:
                self.pool = RewardPool(self.fn_name, self.cfg.num_workers, self.cfg.timeout_s)
            outcomes = self.pool.score(responses, ground_truths, samples)
        return apply_error_policy(
            outcomes, self.fn_name, responses, ground_truths, samples, self.cfg.on_error
        )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
