"""A whole run with a reward model beside a flaky rule reward in the pool, TensorBoard on,
then its curves drawn."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def test_reward_model_with_flaky_rule_reward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    plugin = REPO / "tests" / "plugins" / "flaky_rewards.py"
    monkeypatch.setenv("RLFRAME_CACHE", str(tmp_path / "cache"))
    metrics = run_recipe(
        out,
        "trainer.total_steps=3",
        "trainer.loggers=[console,jsonl,tensorboard]",
        f"reward.fn={plugin}:char_match_or_fail",
        "reward.on_error=zero",
        "reward.timeout_s=0.5",
        "reward.num_workers=2",
        "reward.model.path=tiny-rm:0",
        "reward.model.weight=0.5",
        "reward.weight=2.0",
    ).metrics
    assert len(metrics) == 3
    for m in metrics:
        # The score is the weighted sum of its parts (no overlong shaping here).
        assert m["reward/score_mean"] == pytest.approx(
            2.0 * m["reward/rule_mean"] + 0.5 * m["reward/model_mean"], abs=1e-4
        )
        assert m["reward/model_mean"] != 0.0
    # Responses starting with '7' hang and with '8' raise (about 1 in 50 each of 256 a step):
    # they score 0 and are counted, and the run goes on.
    assert sum(m["reward/timeouts"] for m in metrics) > 0
    assert sum(m["reward/errors"] for m in metrics) > 0
    print(
        "reward e2e: timeouts",
        [m["reward/timeouts"] for m in metrics],
        "errors",
        [m["reward/errors"] for m in metrics],
        "timing_s/reward",
        [round(m["timing_s/reward"], 2) for m in metrics],
    )
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 3 * 4 and all("reward" in r for r in rollouts)
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tensorboard").iterdir())
    drawn = subprocess.run(
        [sys.executable, "-m", "rlframe.plot", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert drawn.returncode == 0 and (out / "curves.png").stat().st_size > 20_000, drawn.stderr
