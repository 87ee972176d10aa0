"""The distillation objectives' tensor code: the per-token advantage, and the loss term the
training role adds (:class:`~rlframe.algorithms.policy_objective.DistillTerm`)."""

from __future__ import annotations

import torch

from rlframe.algorithms.policy_objective import DistillTerm
from rlframe.config.distill import DistillConfig, DistillObjective


def add_distill_advantage(
    task_advantages: torch.Tensor,
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    coef: float,
    task_weight: float,
) -> torch.Tensor:
    """``task_weight * A_task - coef * (log pi_student - log pi_teacher)`` per sampled token
    (0 elsewhere): each token is pushed towards what the teacher would have said there, by
    how much more (or less) likely the student made it. All ``[rows, width]``."""
    reverse_kl = student_logprobs - teacher_logprobs
    return (task_weight * task_advantages - coef * reverse_kl) * loss_mask


def pick_distill_term(d: DistillConfig) -> DistillTerm | None:
    """The loss term of ``distill.objective`` = k1, k3 or topk_forward_kl (None: no
    distillation, or the advantage objective)."""
    if not d.enabled or d.objective is DistillObjective.advantage:
        return None
    return DistillTerm(d.coef, d.objective.value)
