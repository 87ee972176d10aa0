"""The sync check survives asynchronous training and checks every sync: at
``rollout.max_staleness=1`` (streamed responses, paused at every sync) a weight sync that the
engine loses (tests/plugins/lost_sync.py: the
version is claimed, the weights stay old) stops the run at the step that made it, through the
receiver's probe, in separate placement, where no step has tokens sampled with the weights
the trainer holds, as in colocated placement and in lockstep on the mixture-of-experts
model; ``rollout/sync_check`` is logged at every step before. The bf16 figures are
tests/workers/test_sync_check_bf16.py's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rlframe.loop.sync_check import BROKEN_SYNC_EXIT
from tests.e2e.async_cases import PLACEMENTS
from tests.harness import RunResult, run_recipe, shipped_by_value
from tests.plugins import lost_sync

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

LOSING_WORKER = {
    "colocated": "actor.worker_cls=tests.plugins.lost_sync.LostSyncHybridWorker",
    "separate": "rollout.worker_cls=tests.plugins.lost_sync.LostSyncRolloutWorker",
}
SHORT = [
    "trainer.total_steps=5",
    "data.batch_size=8",
    "rollout.n=8",
    "actor.mini_batch_size=64",
    "actor.micro_batch_size=64",
    "rollout.max_staleness=1",
]
CLEAN = 1e-4
"""The rollout/trainer gap of tokens sampled with the trainer's weights (fp32 numerics)."""
LOST_STEP = lost_sync.LOST_VERSION + 1
"""One sync per step: step s samples with version s - 1, so this step's tokens see the lost
one; the probe sees it a step earlier, at the sync."""


@pytest.fixture
def shipped_plugin() -> Iterator[None]:
    with shipped_by_value(lost_sync):
        yield


@pytest.mark.usefixtures("shipped_plugin")
def test_a_lost_sync_stops_a_separate_async_run(tmp_path: Path) -> None:
    """Separate placement, max_staleness=1: every step after the first trains on tokens one
    version behind, so only the probe checks the syncs; ``rollout/sync_check`` is logged at
    every step, and the lost sync (made at step 2) stops the run at that step."""
    result = run_recipe(
        tmp_path / "run",
        *SHORT,
        LOSING_WORKER["separate"],
        *PLACEMENTS["separate"],
        expect_exit=BROKEN_SYNC_EXIT,
    )
    checks = [m.get("rollout/sync_check") for m in result.metrics]
    fresh = [m.get("rollout/logprob_diff") for m in result.metrics]
    print(f"separate async: sync_check by step {checks}, fresh-token gap {fresh}")
    assert len(checks) == lost_sync.LOST_VERSION and None not in checks, checks
    assert fresh[1:] == [None] * (len(fresh) - 1)  # no fresh token after step 1
    assert all(c < 1 for c in checks[:-1]), checks
    line = result.stderr.strip().splitlines()[-1]
    expected = f"rlframe: weight sync broken at step {lost_sync.LOST_VERSION}: rollout/sync_probe"
    assert line.startswith(expected), result.stderr[-3000:]
    assert f"stale weights after the sync of version {lost_sync.LOST_VERSION}" in line, line


def check_stopped_at_lost_step(result: RunResult) -> list[float]:
    """The run stopped at the step whose sync was lost (the probe: the engine's reading did
    not move while the trainer's did), that step logged, with the broken-sync line and exit
    status; returns the logged rollout/sync_check."""
    diffs = [m.get("rollout/logprob_diff") for m in result.metrics]
    checks = [m["rollout/sync_check"] for m in result.metrics]
    assert len(checks) == lost_sync.LOST_VERSION, checks
    assert all(d is None or d < CLEAN for d in diffs), diffs
    assert all(c < 1 for c in checks[:-1]), checks
    line = result.stderr.strip().splitlines()[-1]
    expected = f"rlframe: weight sync broken at step {lost_sync.LOST_VERSION}: rollout/sync_probe"
    assert line.startswith(expected), result.stderr[-3000:]
    assert "stale weights" in line, line
    return checks


@pytest.mark.usefixtures("shipped_plugin")
def test_lost_sync_stops_an_async_run(tmp_path: Path) -> None:
    """Colocated, max_staleness=1: the stale tokens' gap never stops the run, and the lost
    sync does, at the step that made it."""
    result = run_recipe(
        tmp_path / "run",
        *SHORT,
        LOSING_WORKER["colocated"],
        *PLACEMENTS["colocated"],
        expect_exit=BROKEN_SYNC_EXIT,
    )
    checks = check_stopped_at_lost_step(result)
    stale = [m.get("rollout/logprob_diff_stale", 0.0) for m in result.metrics]
    print(f"colocated async: sync_check by step {checks}, stale gap {stale}")


@pytest.mark.usefixtures("shipped_plugin")
def test_lost_sync_stops_a_moe_run(tmp_path: Path) -> None:
    """Lockstep on tiny-moe:0 with the hf engine (the check is the engine's gap, whichever
    engine; this one's sync does not go through vLLM's expert layout, so only the plug-in's
    lost version breaks it)."""
    result = run_recipe(
        tmp_path / "run",
        "model.path=tiny-moe:0",
        "rollout.engine=hf",
        f"trainer.total_steps={LOST_STEP + 1}",
        "data.batch_size=4",
        "rollout.n=4",
        "actor.mini_batch_size=16",
        "actor.micro_batch_size=16",
        LOSING_WORKER["colocated"],
        *PLACEMENTS["colocated"],
        expect_exit=BROKEN_SYNC_EXIT,
    )
    print(f"tiny-moe:0 lockstep: sync_check by step {check_stopped_at_lost_step(result)}")
