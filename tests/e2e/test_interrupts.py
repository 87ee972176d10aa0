"""Ctrl-C and SIGTERM stop a real run in seconds with one line and exit 130 / 143."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_stops_the_run_with_one_line(tmp_path: Path, signum: signal.Signals) -> None:
    out = tmp_path / "run"
    command = [sys.executable, "-m", "rlframe.main", "+recipe=grpo_tiny"]
    command += ["trainer.total_steps=100", "trainer.save_every=1", f"trainer.output_dir={out}"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        for line in proc.stdout:
            if line.startswith("step 2/"):
                break
        if signum == signal.SIGINT:
            check_a_second_run_is_refused(out, proc.pid, env)
        sent = time.monotonic()
        proc.send_signal(signum)
        rest, err = proc.communicate(timeout=60)
        stopped_in = time.monotonic() - sent
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + signum
    assert stopped_in < 15.0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlframe: interrupted at step ")
    assert "the same command resumes from step " in lines[0]
    for noise in ("Traceback", "KeyboardInterrupt", "Aborted", "core dumped", "*** "):
        assert noise not in rest + err


def hash_run_files(out: Path) -> dict[str, str]:
    """Every file of the run but its logs/ (the paused driver's workers may still log)."""
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and "logs" not in p.relative_to(out).parts
    }


def check_a_second_run_is_refused(out: Path, live_pid: int, env: dict[str, str]) -> None:
    """With the live run paused (so its files hold still), a second run into its folder stops
    before Ray naming its PID, and changes no byte of it."""
    os.kill(live_pid, signal.SIGSTOP)
    try:
        before = hash_run_files(out)
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "rlframe.main",
                "+recipe=grpo_tiny",
                f"trainer.output_dir={out}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
            env=env,
        )
        after = hash_run_files(out)
    finally:
        os.kill(live_pid, signal.SIGCONT)
    assert second.returncode == 2
    assert second.stderr.strip().splitlines() == [
        f"rlframe: config error: trainer.output_dir: {out} is in use by a live run "
        f"(PID {live_pid}); wait for it to end, stop it, or choose another trainer.output_dir"
    ]
    assert after == before and "config.json" in after and "metrics.jsonl" in after
