"""On-policy distillation as the trainer holds it: the teacher stage, the alignment check
and the objective (:mod:`rlframe.distill`), and the stop when the check fails (exit 76)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlframe.config import Config
from rlframe.config.distill import DistillObjective
from rlframe.core.protocol import Batch
from rlframe.distill.alignment import TeacherCheck, pick_teacher_threshold
from rlframe.distill.objectives import add_distill_advantage
from rlframe.distill.teachers import TeacherStage, measure_reading
from rlframe.loop.sync_check import BrokenSyncError

if TYPE_CHECKING:
    from rlframe.rollout.served import ServedModel


class BrokenTeacherError(BrokenSyncError):
    """The alignment check failed at ``step``: the served teachers' log-probs are not the
    teachers' (exit 76, like a broken weight sync)."""

    def __init__(self, step: int, gap: float, threshold: float) -> None:
        RuntimeError.__init__(
            self,
            f"teacher alignment broken at step {step}: distill/teacher_logprob_diff {gap:.3g} "
            f"> distill.max_logprob_diff {threshold:.3g}. The served teachers' log-probs of "
            "the step's tokens are not what the configured teachers compute for those rows: "
            "a row scored by another teacher, a reading shifted by a position, or a teacher "
            "engine holding other weights",
        )
        self.step, self.gap, self.threshold = step, gap, threshold
        self.statistic = "distill/teacher_logprob_diff"


class Distillation:
    """Args: the run's config, the served teachers by name, their resolved folders by name
    (for the alignment check), and the run's device."""

    def __init__(
        self, cfg: Config, teachers: dict[str, ServedModel], paths: dict[str, str], device: str
    ) -> None:
        self.d = d = cfg.distill
        self.stage = TeacherStage(d, teachers, cfg.ray.call_timeout_s)
        threshold = pick_teacher_threshold(d, cfg.model.dtype, device)
        self.check = TeacherCheck(d, paths, threshold, cfg.model.trust_remote_code)
        self.broken: BrokenTeacherError | None = None
        """The alignment check's verdict on the last step (raised after it is logged)."""

    def attach(self, batch: Batch, step: int) -> tuple[Batch, dict[str, float]]:
        """``batch`` with ``teacher_logprobs`` (and the top-k); ``distill/*`` metrics, with
        ``distill/teacher_logprob_diff`` when the alignment check is on."""
        reading = self.stage.read(batch)
        metrics = measure_reading(reading, batch)
        if self.check.threshold is not None:
            gap = self.check.measure(batch, reading)
            metrics["distill/teacher_logprob_diff"] = gap
            if self.check.fails(gap):
                assert self.check.threshold is not None
                self.broken = BrokenTeacherError(step, gap, self.check.threshold)
        return batch.with_tensors(**reading.as_tensors()), metrics

    def shape_advantages(self, advantages: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The task's advantages weighted by ``distill.task_weight``, plus the teacher's
        per-token signal under the advantage objective."""
        if self.d.objective is not DistillObjective.advantage:
            return advantages * self.d.task_weight
        return add_distill_advantage(
            advantages,
            batch.tensor("rollout_logprobs"),
            batch.tensor("teacher_logprobs"),
            batch.tensor("loss_mask"),
            self.d.coef,
            self.d.task_weight,
        )

    def take_broken(self) -> BrokenTeacherError | None:
        broken, self.broken = self.broken, None
        return broken
