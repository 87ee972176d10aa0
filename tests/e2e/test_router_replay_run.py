"""A run with ``algorithm.router_replay=rollout`` on the tiny MoE and the ``hf`` engine: each
token's routed experts go from the rollout workers through the driver (dispatch, batch
union, rank balancing) into the old-log-prob pass and the update, step after step (the
second step samples after a weight sync). The numerics of replay are the worker tests'
(tests/workers/test_router_replay.py); this checks the path."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import run_recipe

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_router_replay_run(tmp_path: Path) -> None:
    metrics = run_recipe(
        tmp_path / "run",
        "model.path=tiny-moe:0",
        "rollout.engine=hf",
        "algorithm.router_replay=rollout",
        # The old-log-prob pass replays too; its log-probs are the ones rollout compares.
        "algorithm.recompute_old_logprobs=true",
        "trainer.total_steps=2",
        "data.batch_size=4",
        "rollout.n=4",
        "actor.mini_batch_size=16",
        "actor.micro_batch_size=8",
    ).metrics
    for m in metrics:
        print(
            f"step {m['step']}: routing agreement {m['actor/routing_agreement']:.4f}, "
            f"lp_diff {m['rollout/logprob_diff']:.2e}"
        )
        # fp32 on both sides: the trainer's router would choose as the rollout's did.
        assert m["actor/routing_agreement"] > 0.99
        assert m["rollout/logprob_diff"] < 1e-4
