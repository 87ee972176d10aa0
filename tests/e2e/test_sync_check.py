"""The sync check survives asynchronous training: at ``rollout.max_staleness=1`` a weight sync
that the engine loses (tests/plugins/lost_sync.py: the version is claimed, the weights stay
old) lifts ``rollout/logprob_diff`` at the step that samples on it, and the check reads clean
again once a later sync delivers, with the stale tokens' gap in its own metric. With the
stop on (``rollout.max_logprob_diff``, on by default) the same lost sync ends the run at that
step: an asynchronous run of the dense model (the gap of its fresh tokens) and a lockstep run
of the mixture-of-experts model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rlframe.loop.sync_check import BROKEN_SYNC_EXIT, FP32_MAX_LOGPROB_DIFF
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
    "rollout.partial_chunk_tokens=1",
]
CLEAN = 1e-4
"""The rollout/trainer gap of tokens sampled with the trainer's weights (fp32 numerics)."""
LOST_STEP = lost_sync.LOST_VERSION + 1
"""One sync per step: step s is scored with version s - 1, so this step sees the lost one."""


@pytest.fixture
def shipped_plugin() -> Iterator[None]:
    with shipped_by_value(lost_sync):
        yield


@pytest.mark.usefixtures("shipped_plugin")
def test_lost_sync_lifts_logprob_diff(tmp_path: Path) -> None:
    """Separate placement, the stop off: step 1 checks a delivered sync (the start), the step
    scored with the lost version sees it, and a later step's current tokens (a delivered
    version again) read clean."""
    placement = "separate"
    metrics = run_recipe(
        tmp_path / "run",
        *SHORT,
        "rollout.max_logprob_diff=0",  # measured, not stopped on: the run must go on past it
        LOSING_WORKER[placement],
        *PLACEMENTS[placement],
    ).metrics
    diffs = {m["step"]: m["rollout/logprob_diff"] for m in metrics if "rollout/logprob_diff" in m}
    stale = [m.get("rollout/logprob_diff_stale", 0.0) for m in metrics]
    print(f"{placement}: logprob_diff by step {diffs}, stale {stale}")
    assert diffs.keys() >= {1, LOST_STEP}
    assert diffs[LOST_STEP] > 100 * CLEAN
    clean = {s: d for s, d in diffs.items() if s != LOST_STEP}
    assert all(d < CLEAN for d in clean.values()), clean
    assert max(clean) > LOST_STEP
    # The staleness gap stays out of the check and has its own metric.
    assert max(stale) > 100 * CLEAN


def check_stopped_at_lost_step(result: RunResult) -> list[float]:
    """The run stopped at the lost step on the default fp32 threshold (1e-3), that step
    logged, with the broken-sync line and exit status; returns the logged gaps."""
    diffs = [m.get("rollout/logprob_diff") for m in result.metrics]
    assert len(diffs) == LOST_STEP and diffs[-1] is not None
    assert all(d is None or d < CLEAN for d in diffs[:-1]), diffs
    assert diffs[-1] > 10 * FP32_MAX_LOGPROB_DIFF, diffs
    line = result.stderr.strip().splitlines()[-1]
    expected = f"rlframe: weight sync broken at step {LOST_STEP}: rollout/logprob_diff "
    assert line.startswith(expected), result.stderr[-3000:]
    assert "rollout.max_logprob_diff 0.001" in line and "not sampling" in line, line
    return diffs


@pytest.mark.usefixtures("shipped_plugin")
def test_lost_sync_stops_an_async_run(tmp_path: Path) -> None:
    """Colocated, max_staleness=1: the check reads the fresh tokens' gap, so the stale
    tokens' (~0.1 here) never stop the run, and the lost sync does, at its step."""
    result = run_recipe(
        tmp_path / "run",
        *SHORT,
        LOSING_WORKER["colocated"],
        *PLACEMENTS["colocated"],
        expect_exit=BROKEN_SYNC_EXIT,
    )
    diffs = check_stopped_at_lost_step(result)
    stale = [m.get("rollout/logprob_diff_stale", 0.0) for m in result.metrics]
    print(f"colocated async: logprob_diff by step {diffs}, stale {stale}")
    assert max(stale) > 100 * CLEAN


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
    print(f"tiny-moe:0 lockstep: logprob_diff by step {check_stopped_at_lost_step(result)}")
