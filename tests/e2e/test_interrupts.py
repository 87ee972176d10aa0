"""Ctrl-C and SIGTERM stop a real run in seconds with one line and exit 130 / 143."""

from __future__ import annotations

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
