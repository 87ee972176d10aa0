"""The teacher-alignment check: what the served teachers returned for a step, read again by
the training stack.

A few rows of each step are scored again by a transformers forward of the teacher the row's
data column names in the config (the folder itself, not the engine that served it), and
the largest per-token gap is ``distill/teacher_logprob_diff``. The plumbing errors users hit
with distillation are all large on it: a reading shifted by one position (nats), a row
served by another data source's teacher (nats), a teacher that loaded other weights.
"""

from __future__ import annotations

from typing import Any

import torch

from rlframe.config.distill import DistillConfig
from rlframe.core.protocol import Batch
from rlframe.distill.teachers import TeacherReading, pick_teacher, read_sequences
from rlframe.rollout.turns import score_with_model

FP32_MAX_TEACHER_DIFF = 1e-3
HALF_MAX_TEACHER_DIFF = 0.1


def pick_teacher_threshold(d: DistillConfig, dtype: str, device: str) -> float | None:
    """``distill.max_logprob_diff`` as set (0: off), or by the engines' dtype."""
    if d.max_logprob_diff == 0:
        return None
    if d.max_logprob_diff is not None:
        return d.max_logprob_diff
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return FP32_MAX_TEACHER_DIFF if dtype == "float32" else HALF_MAX_TEACHER_DIFF


class TeacherCheck:
    """Args: the ``distill`` section, each teacher's resolved folder by name, the
    threshold (None: off), and whether the folders need ``trust_remote_code``."""

    def __init__(
        self,
        d: DistillConfig,
        paths: dict[str, str],
        threshold: float | None,
        trust_remote_code: bool = False,
    ) -> None:
        self.d, self.paths, self.threshold = d, paths, threshold
        self.trust_remote_code = trust_remote_code
        self.models: dict[str, Any] = {}
        """Each teacher's transformers model (fp32, on this process's CPU), loaded once."""

    def measure(self, batch: Batch, reading: TeacherReading) -> float:
        """The largest |served - transformers| log-prob over the checked rows' responses."""
        sequences = read_sequences(batch)
        extras = batch.column("extra")
        rows = [i for i, (ids, start) in enumerate(sequences) if start < len(ids)]
        step = max(1, len(rows) // self.d.check_rows)
        worst = 0.0
        for i in rows[::step][: self.d.check_rows]:
            ids, start = sequences[i]
            # The teacher the config names for this row: not the one the stage picked.
            name = pick_teacher(dict(extras[i]), self.d)
            expected = self.read_with_transformers(self.paths[name], ids, start)
            served = reading.logprobs[i, : len(ids) - start]
            worst = max(worst, float((served - expected).abs().max()))
        return worst

    def fails(self, gap: float) -> bool:
        """The gap is over the threshold (never when the check is off)."""
        return self.threshold is not None and gap > self.threshold

    @torch.no_grad()
    def read_with_transformers(self, path: str, ids: list[int], start: int) -> torch.Tensor:
        model = self.models.get(path)
        if model is None:
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging

            # Its loading bar would land on the console, between two step lines.
            hf_logging.disable_progress_bar()
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    path, dtype=torch.float32, trust_remote_code=self.trust_remote_code
                ).eval()
            finally:
                hf_logging.enable_progress_bar()
            self.models[path] = model
        return torch.tensor(score_with_model(model, ids, start, 0).logprobs)
