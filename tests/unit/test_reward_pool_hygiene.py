"""The reward pool used directly: what ``score`` returns by default and under ``fail_fast``,
short limits kept, a driver that sleeps while it waits, how a worker's death is named, and
a pool that reaps every process and closes every pipe it opened."""

from __future__ import annotations

import gc
import time
import warnings
from pathlib import Path

import pytest

from rlframe.rewards import RewardError
from rlframe.rewards.pool import RewardPool

PLUGIN = '''
import os, time

def behave(response, ground_truth, sample):
    """A number, hang, sleep:S, exit0 (the process ends cleanly mid-sample) or raise."""
    if response == "hang":
        time.sleep(3600)
    if response.startswith("sleep:"):
        time.sleep(float(response[6:]))
        return 1.0
    if response == "exit0":
        os._exit(0)
    if response == "raise":
        raise ValueError("bad sample")
    return float(response)
'''


@pytest.fixture()
def spec(tmp_path: Path) -> str:
    path = tmp_path / "behave.py"
    path.write_text(PLUGIN)
    return f"{path}:behave"


def score(pool: RewardPool, responses: list[str], **kwargs: object) -> list:
    return pool.score(responses, ["x"] * len(responses), [{} for _ in responses], **kwargs)


@pytest.mark.timeout(60)
def test_every_sample_is_scored_by_default_and_fail_fast_cancels_the_rest(spec: str) -> None:
    pool = RewardPool(spec, 1, 30.0)
    try:
        outcomes = score(pool, ["0.5", "raise", "0.25"])
        assert [o.score for o in outcomes] == [0.5, None, 0.25]
        assert "ValueError: bad sample" in outcomes[1].error
        assert not any(o.cancelled or o.timed_out for o in outcomes)
        outcomes = score(pool, ["0.5", "raise", "0.25", "1"], fail_fast=True)
        assert [o.score for o in outcomes] == [0.5, None, None, None]
        assert [o.cancelled for o in outcomes] == [False, False, True, True]
        assert outcomes[2].error == "cancelled after another sample failed"
    finally:
        pool.close()


@pytest.mark.timeout(60)
def test_a_short_limit_is_kept(spec: str) -> None:
    pool = RewardPool(spec, 1, 0.3)
    try:
        start = time.monotonic()
        (outcome,) = score(pool, ["hang"])
        elapsed = time.monotonic() - start
        assert outcome.timed_out and outcome.error == "timed out after 0.3 s (reward.timeout_s)"
        assert 0.3 <= elapsed < 0.8, elapsed
    finally:
        pool.close()


@pytest.mark.timeout(60)
def test_the_driver_sleeps_while_it_waits(spec: str) -> None:
    pool = RewardPool(spec, 1, 30.0)
    try:
        cpu = time.process_time()
        assert [o.score for o in score(pool, ["sleep:1"])] == [1.0]
        # Waiting for the answer is one blocking select, not a busy loop.
        assert time.process_time() - cpu < 0.1
    finally:
        pool.close()


@pytest.mark.timeout(60)
def test_a_worker_that_exits_cleanly_mid_sample_is_named(spec: str) -> None:
    pool = RewardPool(spec, 1, 30.0)
    try:
        outcomes = score(pool, ["exit0", "0.5"])
        assert outcomes[0].score is None
        assert outcomes[0].error == "killed its scoring process (exit code 0)"
        assert outcomes[1].score == 0.5
    finally:
        pool.close()


@pytest.mark.timeout(60)
def test_every_worker_is_reaped_and_every_pipe_closed(spec: str, tmp_path: Path) -> None:
    """Python warns (ResourceWarning) about a child never waited for and a pipe never
    closed: through a timeout, a death, a failed start and close, none may be left."""
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('cannot load')\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        pool = RewardPool(spec, 2, 0.5)
        try:
            outcomes = score(pool, ["hang", "exit0", "0.5"])
            assert [o.score for o in outcomes] == [None, None, 0.5]
        finally:
            pool.close()
        with pytest.raises(RewardError, match="could not start: .*cannot load"):
            RewardPool(f"{broken}:fn", 1, 5.0)
        del pool
        gc.collect()
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert leaks == []


@pytest.mark.timeout(60)
def test_a_stage_stopped_at_its_deadline_kills_its_busy_workers_and_replaces_them(
    spec: str,
) -> None:
    pool = RewardPool(spec, 2, 30.0)
    try:
        first = [w.proc for w in pool.ready]
        outcomes = score(pool, ["hang", "hang", "0.5"], deadline_s=0.5)
        assert [o.timed_out for o in outcomes] == [True, True, True]
        # The two hung workers are dead; two fresh ones score the next call.
        assert all(proc.poll() is not None for proc in first)
        assert len(pool.ready) + len(pool.starting) == 2
        assert [o.score for o in score(pool, ["0.5", "0.25"])] == [0.5, 0.25]
    finally:
        pool.close()
