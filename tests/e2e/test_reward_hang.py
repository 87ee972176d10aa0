"""A reward that hangs stops a real run at the first sample's limit, naming the sample."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HANG = "import time\n\ndef hang(response, ground_truth, sample):\n    time.sleep(3600)\n"


@pytest.mark.slow
def test_a_hanging_reward_stops_the_run_at_its_first_limit(tmp_path: Path) -> None:
    plugin = tmp_path / "hang.py"
    plugin.write_text(HANG)
    command = [sys.executable, "-m", "rlframe.main", "+recipe=grpo_tiny"]
    command += [f"reward.fn={plugin}:hang", "reward.timeout_s=3"]
    command += ["trainer.total_steps=3", f"trainer.output_dir={tmp_path / 'run'}"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    start = time.monotonic()
    # 256 samples on 2 workers, each to its own 3 s limit, would take over 6 minutes.
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=REPO, env=env)
    took = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "hang timed out after 3 s (reward.timeout_s) on sample " in lines[0]
    assert "step 1/" not in result.stdout
    print(f"stopped {took:.1f} s after the start (start-up included)")
    assert took < 240
