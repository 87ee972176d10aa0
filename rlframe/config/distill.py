"""The ``distill`` section: on-policy distillation from served teachers.

The student (the policy) samples; a teacher scores every sampled token (its log-prob, and
its top-k for the top-k objective) and the student is trained towards it on its own
samples. The teachers are served models (:mod:`rlframe.config.served`: the serving keys
live in this section too, shared by every teacher).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from rlframe.config.checks import require
from rlframe.config.served import MAX_TOP_K, ServedModelConfig


class DistillObjective(str, Enum):
    """How the teacher's reading trains the student."""

    advantage = "advantage"
    """``-coef * (log pi_student - log pi_teacher)`` per sampled token, added to the task
    reward's advantage and trained by the policy loss (slime's OPD, veRL's k1 reward)."""
    k1 = "k1"
    """A loss term ``coef * mean(log pi_student - log pi_teacher)`` on the sampled tokens."""
    k3 = "k3"
    """A loss term with the k3 estimator (``exp(d) - d - 1``, ``d = log pi_T - log pi_S``)."""
    topk_forward_kl = "topk_forward_kl"
    """A loss term: forward KL from the teacher's top-k distribution at each sampled
    position (renormalised over its top ``distill.top_k`` tokens), GKD style."""


@dataclass
class DistillConfig(ServedModelConfig):
    teacher: str | None = None
    """The teacher for every prompt: an HF folder, hub id or tiny-model id (``tiny:3``).
    null (default) with no ``teachers``: no distillation."""
    teachers: dict[str, str] = field(default_factory=dict)
    """Several teachers, chosen per prompt by the value of ``teacher_column`` in the data:
    ``{math: /models/math-teacher, code: /models/code-teacher}``."""
    teacher_column: str = "data_source"
    """The prompt column that picks a prompt's teacher among ``teachers``."""
    objective: DistillObjective = DistillObjective.advantage
    """advantage (default), k1, k3 or topk_forward_kl: see :class:`DistillObjective`."""
    coef: float = 1.0
    """Weight of the distillation signal (the advantage's or the loss term's)."""
    task_weight: float = 1.0
    """Weight of the task reward's advantage beside it; 0: pure distillation (no reward)."""
    top_k: int = 8
    """objective=topk_forward_kl: the teacher's most likely tokens per position."""
    max_logprob_diff: float | None = None
    """The teacher-alignment check: the served teacher's log-probs of a few of the step's
    rows against the same teacher run by the training stack (a transformers forward); the run
    stops (exit 76) when they differ by more than this many nats (the largest per-token
    gap). null: 1e-3 in float32, 0.1 in bfloat16; 0: off."""
    check_rows: int = 2
    """Rows of each step the alignment check reads."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.objective, str):
            self.objective = DistillObjective(self.objective)
        require(
            not (self.teacher and self.teachers),
            "distill.teachers",
            "give one teacher for every prompt (distill.teacher) or teachers by "
            f"{self.teacher_column} (distill.teachers), not both",
        )
        require(
            math.isfinite(self.coef) and self.coef > 0,
            "distill.coef",
            f"must be a finite number > 0, got {self.coef}",
        )
        require(
            math.isfinite(self.task_weight) and self.task_weight >= 0,
            "distill.task_weight",
            f"must be a finite number >= 0 (0: pure distillation), got {self.task_weight}",
        )
        require(
            1 <= self.top_k <= MAX_TOP_K,
            "distill.top_k",
            f"must be in 1..{MAX_TOP_K} (the engines return at most {MAX_TOP_K} log-probs a "
            f"position), got {self.top_k}",
        )
        require(
            self.max_logprob_diff is None or self.max_logprob_diff >= 0,
            "distill.max_logprob_diff",
            f"must be >= 0 nats (0: off; null: by dtype), got {self.max_logprob_diff}",
        )
        require(self.check_rows >= 1, "distill.check_rows", f"must be >= 1, got {self.check_rows}")

    @property
    def enabled(self) -> bool:
        return bool(self.teacher or self.teachers)
