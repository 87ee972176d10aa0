"""Colocated asynchronous training keeps the rollout engine awake across the chunk calls of
one generation phase: per step it sleeps once (for the trainer's passes) and wakes only in the
weight push (weights, then KV cache), however many chunks the phase ran."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.async_cases import PLACEMENTS
from tests.harness import run_recipe, shipped_by_value
from tests.plugins import engine_calls

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


@pytest.fixture
def shipped_plugin() -> Iterator[None]:
    with shipped_by_value(engine_calls):
        yield


@pytest.mark.usefixtures("shipped_plugin")
def test_colocated_async_sleeps_once_per_step(tmp_path: Path) -> None:
    run = run_recipe(
        tmp_path / "run",
        "trainer.total_steps=3",
        "data.batch_size=8",
        "rollout.n=8",
        "actor.mini_batch_size=64",
        "actor.micro_batch_size=64",
        "rollout.max_staleness=1",
        "rollout.partial_chunk_tokens=1",
        "actor.worker_cls=tests.plugins.engine_calls.CountingHybridWorker",
        *PLACEMENTS["colocated"],
    )
    lines = (run.run_dir / engine_calls.LOG_NAME).read_text().splitlines()
    steps = [json.loads(line) for line in lines]
    print(steps)
    assert len(steps) == 3
    # Chunks of one token over max_tokens=3: a generation phase is several engine calls.
    assert max(s["generate"] for s in steps) >= 3
    for s in steps:
        assert s["sleep"] == 1, steps
        assert s["wake_up"] == 2, steps
