"""The TensorBoard sink records every metric per step; rlframe.plot draws a run's curves."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from rlframe.observability.tracking import Tracker
from rlframe.plot import plot_run, read_metrics, stage_keys


def fake_step(step: int) -> dict[str, float]:
    return {
        "reward/mean": 1 - math.exp(-step / 10),
        "response_length/mean": 20 + step,
        "response_length/max": 40 + step,
        "actor/entropy": 2 * math.exp(-step / 20),
        "actor/kl": 0.001 * step,
        "timing_s/gen": 0.5,
        "timing_s/reward": 0.1,
        "timing_s/update": 0.8,
        "timing_s/step": 1.4,
    }


def read_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_tensorboard_sink_and_resume_purge(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path, ["jsonl", "tensorboard"], 10, {}, "p", "e")
    for step in range(1, 7):
        tracker.log(step, fake_step(step))
    tracker.close()
    values = read_scalars(tmp_path / "tensorboard", "reward/mean")
    assert [s for s, _ in values] == [1, 2, 3, 4, 5, 6]
    assert abs(values[2][1] - fake_step(3)["reward/mean"]) < 1e-6
    # Resumed from step 4: steps 5 and 6 of the crashed run are replaced, not duplicated.
    resumed = Tracker(tmp_path, ["tensorboard"], 10, {}, "p", "e")
    for step in range(5, 9):
        resumed.log(step, {"reward/mean": 10.0 + step})
    resumed.close()
    values = dict(read_scalars(tmp_path / "tensorboard", "reward/mean"))
    assert sorted(values) == list(range(1, 9))
    assert (
        values[6] == 16.0 and abs(values[4] - fake_step(4)["reward/mean"]) < 1e-6
    )  # float32 in events


def test_plot_writes_a_png_with_every_panel(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path, ["jsonl"], 30, {}, "p", "e")
    tracker.log(0, {"val/reward/mean": 0.05})
    for step in range(1, 31):
        tracker.log(
            step, fake_step(step) | ({"val/reward/mean": step / 40} if step % 10 == 0 else {})
        )
    rows = read_metrics(tmp_path)
    assert stage_keys(rows) == [
        "timing_s/gen",
        "timing_s/reward",
        "timing_s/update",
        "timing_s/step",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "rlframe.plot", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    png = tmp_path / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert plot_run(tmp_path, tmp_path / "other.png") == tmp_path / "other.png"


def test_plot_of_a_folder_without_metrics_says_so(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rlframe.plot", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "no metrics.jsonl" in done.stderr
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    assert plot_run(tmp_path).is_file()  # panels it cannot fill say "not logged by this run"


def test_validation_figures_reach_the_console_at_their_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tracker = Tracker(tmp_path, ["console"], 10, {}, "p", "e")
    val = {"val/reward/mean": 0.5, "val/pass@1": 0.25, "val/pass@4": 0.75, "val/pass@2": 0.5}
    tracker.log(0, dict(val))
    tracker.log(1, {"reward/mean": 0.1})
    tracker.log(2, {"reward/mean": 0.2, **val, "val/gsm8k/pass@1": 0.3})
    lines = capsys.readouterr().out.splitlines()
    line = "val step {} | reward 0.5 | pass@1 0.25 | pass@2 0.5 | pass@4 0.75"
    assert lines == [
        "step 0/10",
        line.format(0),
        "step 1/10 | reward 0.1",
        "step 2/10 | reward 0.2",
        line.format(2),
    ]
