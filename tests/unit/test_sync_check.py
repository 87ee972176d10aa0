"""The sync check (rlframe/loop/sync_check.py): ``rollout.max_logprob_diff``, its default by dtype,
the check itself, and a loop that stops on it with the failing step logged and not saved."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from rlframe.config import ConfigError
from rlframe.loop.sync_check import (
    FP32_MAX_LOGPROB_DIFF,
    HALF_MAX_LOGPROB_DIFF,
    ROW_FACTOR,
    TOKEN_MEAN_FACTOR,
    BrokenProbeError,
    BrokenSyncError,
    SyncCheck,
    check_sync_gap,
    describe_broken_sync,
    pick_max_logprob_diff,
)
from rlframe.loop.trainer import Trainer
from rlframe.state.checkpoint import Checkpointer
from rlframe.state.checkpoint_layout import list_checkpoints
from tests.unit.cli_errors import check_config_error
from tests.unit.config_trees import build


@pytest.mark.parametrize(
    ("model", "device", "expected"),
    [
        ("auto", "cpu", FP32_MAX_LOGPROB_DIFF),
        ("auto", "cuda", HALF_MAX_LOGPROB_DIFF),
        ("float32", "cuda", FP32_MAX_LOGPROB_DIFF),
        ("bfloat16", "cpu", HALF_MAX_LOGPROB_DIFF),
    ],
)
def test_the_default_follows_the_weights_dtype(model: str, device: str, expected: float) -> None:
    cfg = build(model={"path": "tiny:0", "dtype": model})
    assert pick_max_logprob_diff(cfg, device) == expected


def test_the_default_makes_room_for_the_nucleus() -> None:
    """vLLM's log-prob of a nucleus token is renormalised by the nucleus mass (>= top_p)."""
    cfg = build(rollout={"n": 4, "top_p": 0.9})
    assert pick_max_logprob_diff(cfg, "cpu") == pytest.approx(1e-3 + math.log(1 / 0.9))


def test_a_set_value_is_kept_and_zero_or_rollout_logprobs_turn_it_off() -> None:
    cfg = build(rollout={"n": 4, "max_logprob_diff": 0.2}, model={"path": "tiny:0"})
    assert pick_max_logprob_diff(cfg, "cuda") == 0.2
    assert pick_max_logprob_diff(build(rollout={"n": 4, "max_logprob_diff": 0}), "cpu") is None
    own = build(algorithm={"off_policy_correction": "rollout"})
    assert pick_max_logprob_diff(own, "cpu") is None


def test_the_check_stops_above_the_threshold_only() -> None:
    check_sync_gap(3, {"rollout/logprob_diff": 1e-3}, 1e-3)
    check_sync_gap(3, {"rollout/logprob_diff": 5.0}, None)
    check_sync_gap(3, {"rollout/logprob_diff_stale": 5.0}, 1e-3)  # no fresh token: no check
    with pytest.raises(BrokenSyncError) as caught:
        check_sync_gap(3, {"rollout/logprob_diff": 0.0812}, 1e-3)
    error = caught.value
    assert (error.step, error.gap, error.threshold) == (3, 0.0812, 1e-3)
    text = str(error)
    for part in ("step 3", "0.0812", "rollout.max_logprob_diff 0.001", "not sampling"):
        assert part in text, text
    with pytest.raises(BrokenSyncError):
        check_sync_gap(1, {"rollout/logprob_diff": math.nan}, 1e-3)


def test_bad_settings_stop_before_ray() -> None:
    check_config_error(
        "+recipe=grpo_tiny",
        "rollout.max_logprob_diff=-0.1",
        key="rollout.max_logprob_diff",
        text="must be >= 0",
    )
    with pytest.raises(ConfigError, match="rollout.max_logprob_diff: 0.1 cannot be checked"):
        build(
            algorithm={"off_policy_correction": "rollout"},
            rollout={"n": 4, "max_logprob_diff": 0.1},
        )


def test_nan_is_no_threshold() -> None:
    with pytest.raises(ConfigError, match="rollout.max_logprob_diff: must be a finite number"):
        build(rollout={"n": 4, "max_logprob_diff": math.nan})


class GapTracker:
    def __init__(self) -> None:
        self.logged: list[int] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.logged.append(step)


def test_a_failing_step_is_logged_not_saved(tmp_path: Path) -> None:
    """Step 3's engine samples with weights the sync did not deliver: the loop logs it, saves
    nothing for it, and stops; the checkpoint of step 2 stays the latest."""
    gaps = {1: 2e-7, 2: 3e-7, 3: 0.06, 4: 2e-7}

    class GapTrainer(Trainer):
        def step(self) -> dict[str, float]:
            return {"rollout/logprob_diff": gaps[self.step_count]}

        def state_dict(self) -> dict[str, Any]:
            return {"seed": 0, "step": self.step_count}

    loop = GapTrainer.__new__(GapTrainer)
    loop.cfg = build(trainer={"output_dir": str(tmp_path), "total_steps": 4, "save_every": 1})
    loop.step_count, loop.validator, loop.tracker = 0, None, GapTracker()
    loop.checkpointer = Checkpointer(tmp_path, 10, {}, lambda d: d.mkdir(), export_hf=False)
    loop.sync_check, loop.probes, loop.scored_with = SyncCheck(1e-3, calibrate=False), [], 1
    loop.distillation = None
    with pytest.raises(BrokenSyncError) as caught:
        loop.fit()
    assert loop.tracker.logged == [1, 2, 3]
    saved = [p.name for p in list_checkpoints(tmp_path / "checkpoints")]
    assert saved == ["step_00000001", "step_00000002"]
    line = describe_broken_sync(caught.value, tmp_path)
    assert "step 3 is logged" in line and "checkpoint of step 2 is intact" in line, line
    assert "rollout.max_logprob_diff=0" in line


HONEST = 1.04e-3
"""The bf16 honest token mean measured on tiny-moe:0 (tests/workers/test_sync_check_bf16.py)."""


def test_the_thresholds_are_calibrated_at_version_0_in_the_runs_dtype() -> None:
    """bf16: before calibration the token mean has the dtype's fixed 0.05; the step scored
    with version 0 measures the honest gap, and later steps stop at a multiple of it plus
    the fp32 floor, on the mean and on the largest row's mean."""
    check = SyncCheck.for_run(build(model={"path": "tiny:0", "dtype": "bfloat16"}), "cpu")
    assert check.limits() == {"rollout/logprob_diff": HALF_MAX_LOGPROB_DIFF}
    step1 = {"rollout/logprob_diff": HONEST, "rollout/logprob_diff_row_max": 0.03}
    assert check.judge(1, step1, 0, []) is None  # the row statistic waits for calibration
    assert check.honest == HONEST
    limits = check.limits()
    assert limits == {
        "rollout/logprob_diff": pytest.approx(TOKEN_MEAN_FACTOR * HONEST + 1e-3),
        "rollout/logprob_diff_row_max": pytest.approx(ROW_FACTOR * HONEST + 1e-3),
    }
    # Two swapped experts of 8 (measured): mean 0.011, largest row 0.021.
    swapped = {"rollout/logprob_diff": 0.011, "rollout/logprob_diff_row_max": 0.021}
    error = check.judge(5, swapped, 4, [])
    assert isinstance(error, BrokenSyncError) and error.statistic == "rollout/logprob_diff"
    assert swapped["rollout/sync_check"] == pytest.approx(0.011 / limits["rollout/logprob_diff"])
    # A corruption of a few rows: the mean stays honest, one row's mean does not.
    few_rows = {"rollout/logprob_diff": 2e-3, "rollout/logprob_diff_row_max": 0.3}
    error = check.judge(6, few_rows, 5, [])
    assert error is not None and error.statistic == "rollout/logprob_diff_row_max"
    honest = {"rollout/logprob_diff": 2.0e-3, "rollout/logprob_diff_row_max": 1.1e-2}
    assert check.judge(7, honest, 6, []) is None
    assert 0.4 < honest["rollout/sync_check"] < 1


def test_a_broken_first_step_is_no_calibration() -> None:
    check = SyncCheck.for_run(build(model={"path": "tiny:0", "dtype": "bfloat16"}), "cpu")
    assert check.judge(1, {"rollout/logprob_diff": 0.3}, 0, []) is not None
    assert check.honest is None


def test_fp32_keeps_its_fixed_threshold_and_a_set_value_is_not_calibrated() -> None:
    check = SyncCheck.for_run(build(model={"path": "tiny:0"}), "cpu")
    check.judge(1, {"rollout/logprob_diff": 3e-7, "rollout/logprob_diff_row_max": 1e-6}, 0, [])
    assert check.limits()["rollout/logprob_diff"] == pytest.approx(1e-3, rel=1e-5)
    fixed = SyncCheck.for_run(build(rollout={"n": 4, "max_logprob_diff": 0.2}), "cpu")
    fixed.judge(1, {"rollout/logprob_diff": 1e-3, "rollout/logprob_diff_row_max": 0.5}, 0, [])
    assert fixed.honest is None and fixed.limits() == {"rollout/logprob_diff": 0.2}


def test_the_probe_checks_a_step_without_fresh_tokens() -> None:
    """Separate placement at max_staleness=1: no fresh token, the probe's verdict is the
    check; the worst rank's is logged, a failed one stops the run with its reason."""
    check = SyncCheck.for_run(build(model={"path": "tiny:0"}), "cpu")
    metrics = {"rollout/logprob_diff_stale": 0.1}
    ok = {"version": 3, "ratio": 0.2, "error": None}
    assert check.judge(3, metrics, 2, [ok, None]) is None
    assert metrics["rollout/sync_check"] == metrics["rollout/sync_probe"] == 0.2
    stale = {"version": 3, "ratio": 0.1, "error": "stale weights after the sync of version 3"}
    error = check.judge(3, {}, 2, [ok, stale])
    assert isinstance(error, BrokenProbeError) and "stale weights" in str(error)
    assert str(error).startswith("weight sync broken at step 3: rollout/sync_probe")
    off = SyncCheck(None)
    assert off.judge(3, metrics, 2, [stale]) is None
