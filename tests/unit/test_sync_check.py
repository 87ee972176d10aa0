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
    BrokenSyncError,
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
    loop.max_logprob_diff = 1e-3
    with pytest.raises(BrokenSyncError) as caught:
        loop.fit()
    assert loop.tracker.logged == [1, 2, 3]
    saved = [p.name for p in list_checkpoints(tmp_path / "checkpoints")]
    assert saved == ["step_00000001", "step_00000002"]
    line = describe_broken_sync(caught.value, tmp_path)
    assert "step 3 is logged" in line and "checkpoint of step 2 is intact" in line, line
    assert "rollout.max_logprob_diff=0" in line
