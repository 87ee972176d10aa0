"""The start-up clock: consecutive phases that add up to the total, workers' parts attached,
the process's own start as the first run's origin, and the run's closing line."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlframe.observability import startup
from rlframe.observability.startup import StartupClock, process_start_time
from rlframe.run.launch import describe_finished_run


def test_phases_are_consecutive_and_add_up_to_the_total() -> None:
    clock = StartupClock(origin=time.time())
    time.sleep(0.02)
    first = clock.mark("config")
    time.sleep(0.03)
    second = clock.mark("ray")
    assert 0.02 <= first < 0.5 and 0.03 <= second < 0.5
    assert list(clock.phases) == ["config", "ray"]
    assert clock.total == pytest.approx(first + second, abs=1e-9)


def test_describe_names_each_phase_and_the_workers_parts() -> None:
    clock = StartupClock(origin=100.0)
    clock.phases = {"config": 0.51, "workers": 6.04}
    clock.attach("workers", {"boot": 2.0, "rollout_engine": 3.96}, prefix="actor ")
    assert clock.describe() == "config 0.5, workers 6.0 (actor boot 2.0, actor rollout_engine 4.0)"


def test_the_first_run_counts_from_the_process_start() -> None:
    # This process started before the test ran (pytest's own start-up is seconds).
    assert process_start_time() < time.time() - 0.1
    startup.RUNS_BEGUN.clear()
    startup.begin_driver_clock()
    first = startup.DRIVER
    assert first.origin == pytest.approx(process_start_time(), abs=0.05)
    assert first.phases["interpreter"] > 0.1
    startup.begin_driver_clock()  # a second run of the same process counts from its own start
    assert startup.DRIVER.origin > first.origin + 0.1
    assert startup.DRIVER.phases["interpreter"] < 0.1


def test_the_closing_line_gives_steps_wall_time_reward_trend_and_outputs(tmp_path: Path) -> None:
    history = [{"reward/mean": r} for r in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)]
    startup.DRIVER = StartupClock(origin=time.time() - 42.2)
    line = describe_finished_run(history, tmp_path)
    assert line == (
        f"rlframe: done: 8 step(s) in 42 s; reward 0.200 (first 5) -> 0.500 (last 5); "
        f"outputs in {tmp_path}"
    )
    assert describe_finished_run([], tmp_path).startswith("rlframe: done: 0 step(s) in 42 s;")


def test_the_launcher_starts_ray_before_the_heavy_imports() -> None:
    """rlframe.main and the launcher import no torch, transformers or vLLM: run_training
    begins Ray's start before it imports the loop (rlframe.run.assembly), so those seconds
    overlap Ray's. A heavy import moved back to the top of either module fails this."""
    probe = (
        "import sys, rlframe.main, rlframe.run.launch; "
        "print([m for m in ('torch', 'transformers', 'vllm') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
