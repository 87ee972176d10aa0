"""A reward that hangs stops a real run at the first sample's limit, naming the sample."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.harness import run_recipe

HANG = "import time\n\ndef hang(response, ground_truth, sample):\n    time.sleep(3600)\n"


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_hanging_reward_stops_the_run_at_its_first_limit(tmp_path: Path) -> None:
    plugin = tmp_path / "hang.py"
    plugin.write_text(HANG)
    start = time.monotonic()
    # 256 samples on 2 workers, each to its own 3 s limit, would take over 6 minutes.
    result = run_recipe(
        tmp_path / "run",
        f"reward.fn={plugin}:hang",
        "reward.timeout_s=3",
        "trainer.total_steps=3",
        expect_exit=1,
    )
    took = time.monotonic() - start
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "hang timed out after 3 s (reward.timeout_s) on sample " in lines[0]
    assert "step 1/" not in result.stdout
    print(f"stopped {took:.1f} s after the start (start-up included)")
    assert took < 240
