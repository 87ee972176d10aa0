"""The teacher stage of on-policy distillation: every sampled sequence of a step, scored by
its teacher through the served teacher's request stream.

A row's sequence is its prompt (unpadded) and its whole response; the teacher returns the
log-prob of each response token given everything before it (``score_from`` = the prompt's
length) and, for the top-k objective, its most likely tokens at each response position. The
readings are laid on the response grid (``[rows, width]``, 0 past a response's end) beside
the rollout's own log-probs, so position ``t`` of ``teacher_logprobs`` and of
``rollout_logprobs`` always read the same token.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlframe.config.distill import DistillConfig, DistillObjective
from rlframe.core.protocol import Batch
from rlframe.rollout.turns import TurnResult, build_score_request

if TYPE_CHECKING:
    from rlframe.rollout.served import ServedModel

TEACHER_LOGPROBS = "teacher_logprobs"
TEACHER_TOP_IDS = "teacher_top_ids"
TEACHER_TOP_LOGPROBS = "teacher_top_logprobs"


def pick_teacher(extra: dict[str, object], d: DistillConfig) -> str:
    """The served teacher of a row with the prompt columns ``extra``: ``teacher``, or
    ``teacher/<value>`` by its ``distill.teacher_column``."""
    if d.teacher:
        return "teacher"
    value = extra.get(d.teacher_column)
    if value is None or str(value) not in d.teachers:
        raise KeyError(
            f"a prompt's {d.teacher_column}={value!r} has no teacher in distill.teachers "
            f"({sorted(d.teachers)})"
        )
    return f"teacher/{value}"


def read_sequences(batch: Batch) -> list[tuple[list[int], int]]:
    """Each row's prompt + response ids (padding removed) and where its response starts."""
    prompts, prompt_mask = batch.tensor("prompt_ids"), batch.tensor("prompt_mask").bool()
    responses, lengths = batch.tensor("response_ids"), batch.tensor("response_mask").sum(-1)
    out = []
    for i in range(len(batch)):
        prompt = prompts[i][prompt_mask[i]].tolist()
        out.append((prompt + responses[i, : int(lengths[i])].tolist(), len(prompt)))
    return out


@dataclass
class TeacherReading:
    """The teachers' reading of a step's responses, on the response grid."""

    logprobs: torch.Tensor
    """``[rows, width]``: each response token's log-prob under its row's teacher."""
    top_ids: torch.Tensor | None
    """``[rows, width, k]`` (top-k objective): the teacher's most likely ids per position."""
    top_logprobs: torch.Tensor | None
    """``[rows, width, k]``: their log-probs."""
    teachers: list[str]
    """Each row's teacher."""

    def as_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {TEACHER_LOGPROBS: self.logprobs}
        if self.top_ids is not None and self.top_logprobs is not None:
            tensors |= {TEACHER_TOP_IDS: self.top_ids, TEACHER_TOP_LOGPROBS: self.top_logprobs}
        return tensors


class TeacherStage:
    """Scores each step's responses with the served teachers (all rows at once, every
    teacher's replicas busy together); colocated teachers sleep again afterwards.

    Args:
        d: the ``distill`` section.
        teachers: the served teachers by name (``teacher``, ``teacher/<value>``).
        timeout_s: how long one row's scoring may take.
    """

    def __init__(self, d: DistillConfig, teachers: dict[str, ServedModel], timeout_s: float):
        self.d, self.teachers, self.timeout_s = d, teachers, timeout_s
        self.top_k = d.top_k if d.objective is DistillObjective.topk_forward_kl else 0

    def read(self, batch: Batch) -> TeacherReading:
        """The teachers' reading of ``batch``'s responses."""
        names = [pick_teacher(dict(e), self.d) for e in batch.column("extra")]
        for name in sorted(set(names)):
            self.teachers[name].client.open()
        sequences = read_sequences(batch)
        futures: list[Future[TurnResult] | None] = [
            None
            if start >= len(ids)  # an empty response: nothing to score
            else self.teachers[name].client.submit(
                build_score_request(ids, start, self.top_k), f"row{i}"
            )
            for i, (name, (ids, start)) in enumerate(zip(names, sequences, strict=True))
        ]
        results = [None if f is None else f.result(timeout=self.timeout_s) for f in futures]
        for i, name in enumerate(names):
            # One request a row: the next step's rows go to the least-loaded replica again.
            self.teachers[name].client.end_session(f"row{i}")
        for name in sorted(set(names)):
            self.teachers[name].sleep()
        return self.lay_on_grid(results, names, batch.tensor("response_mask").shape)

    def lay_on_grid(
        self, results: list[TurnResult | None], names: list[str], shape: torch.Size
    ) -> TeacherReading:
        logprobs = torch.zeros(shape)
        top_ids = torch.zeros((*shape, self.top_k), dtype=torch.long) if self.top_k else None
        # 0 past a response: finite, so the masked positions' top-k KL stays finite.
        top_logprobs = torch.zeros((*shape, self.top_k)) if self.top_k else None
        for i, result in enumerate(results):
            if result is None:
                continue
            scored = result.scored
            assert scored is not None, "a scoring request came back without its reading"
            k = len(scored.logprobs)
            logprobs[i, :k] = torch.tensor(scored.logprobs)
            if top_ids is not None and top_logprobs is not None:
                top_ids[i, :k] = torch.tensor(scored.top_ids, dtype=torch.long)
                top_logprobs[i, :k] = torch.tensor(scored.top_logprobs)
        return TeacherReading(logprobs, top_ids, top_logprobs, names)


def measure_reading(reading: TeacherReading, batch: Batch) -> dict[str, float]:
    """``distill/reverse_kl``: the mean over the sampled tokens of ``log pi_student -
    log pi_teacher`` (the student's own log-probs from the rollout: a single-sample estimate
    of KL(student || teacher) per token); with several teachers, per teacher too
    (``distill/reverse_kl/<value>``)."""
    mask = batch.tensor("loss_mask")
    gap = (batch.tensor("rollout_logprobs") - reading.logprobs) * mask
    metrics = {"distill/reverse_kl": float(gap.sum() / mask.sum().clamp(min=1))}
    names = sorted(set(reading.teachers))
    if len(names) > 1:
        for name in names:
            rows = torch.tensor([n == name for n in reading.teachers])
            tokens = mask[rows].sum().clamp(min=1)
            metrics[f"distill/reverse_kl/{name.split('/', 1)[1]}"] = float(gap[rows].sum() / tokens)
    return metrics
