"""The sync check survives asynchronous training: at ``rollout.max_staleness=1`` a weight sync
that the engine loses (tests/plugins/lost_sync.py: the version is claimed, the weights stay
old) lifts ``rollout/logprob_diff`` at the step that samples on it, and the check reads clean
again once a later sync delivers, with the stale tokens' gap in its own metric."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.async_cases import PLACEMENTS
from tests.harness import run_recipe, shipped_by_value
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


@pytest.fixture
def shipped_plugin() -> Iterator[None]:
    with shipped_by_value(lost_sync):
        yield


@pytest.mark.usefixtures("shipped_plugin")
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_lost_sync_lifts_logprob_diff(tmp_path: Path, placement: str) -> None:
    metrics = run_recipe(
        tmp_path / "run", *SHORT, LOSING_WORKER[placement], *PLACEMENTS[placement]
    ).metrics
    diffs = {m["step"]: m["rollout/logprob_diff"] for m in metrics if "rollout/logprob_diff" in m}
    stale = [m.get("rollout/logprob_diff_stale", 0.0) for m in metrics]
    print(f"{placement}: logprob_diff by step {diffs}, stale {stale}")
    # One sync per step: step s is scored with version s - 1. Step 1 checks a delivered
    # sync (the start), the step scored with the lost version sees it, and a later step's
    # current tokens (a delivered version again) read clean.
    lost_step = lost_sync.LOST_VERSION + 1
    assert diffs.keys() >= {1, lost_step}
    assert diffs[lost_step] > 100 * CLEAN
    clean = {s: d for s, d in diffs.items() if s != lost_step}
    assert all(d < CLEAN for d in clean.values()), clean
    assert max(clean) > lost_step
    # The staleness gap stays out of the check and has its own metric.
    assert max(stale) > 100 * CLEAN
