"""The weight sync of a mixture-of-experts policy (``tiny-moe:0``, Qwen3-MoE, 8 experts, top-2)
across pools (``rollout.placement=separate``): after every sync the engine's log-probs of its
own samples match the trainer's (vLLM 0.32's CPU fused-MoE kernel read a sync's experts in
the wrong layout until workers/inference/vllm_moe.py), and a sync that corrupts a single
expert (two experts swapped, or one dropped) shows in the same gap, far above its noise.
"""

from __future__ import annotations

import pytest
import torch
from ray import cloudpickle

from rlframe.controller.worker_group import WorkerGroup
from rlframe.core.protocol import Batch
from rlframe.data.tiny_model import resolve_model_path
from rlframe.run.pools import build_broadcast_sync, join_weight_group, pick_weight_group_spec
from tests.plugins import corrupt_experts
from tests.ray.factories import TinyGroups, logprob_gap, prompts_for, tiny_config
from tests.rows_grid import generate_batch

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]

cloudpickle.register_pickle_by_value(corrupt_experts)

HEALTHY = 1e-4
"""fp32 on CPU: a sync that delivers every expert leaves ~1e-6."""
CORRUPT = 1e-3
"""Where the gap of one corrupted expert (of 8 in one of 2 layers) must lie above."""


WIDTH = 6
"""The response grid's width: tiny_config's ``rollout.max_tokens``."""


def sample(rollout: WorkerGroup, seed: int) -> Batch:
    return generate_batch(rollout.generate, prompts_for(seed), WIDTH)


def measure_gap(trainer: WorkerGroup, rollout: WorkerGroup, seed: int) -> float:
    batch = sample(rollout, seed)
    return logprob_gap(batch, trainer.compute_logprobs(batch)["old_logprobs"])


def update(trainer: WorkerGroup, rollout: WorkerGroup, seed: int) -> None:
    """One update with a strong signal, so that every sync moves the experts."""
    batch = sample(rollout, seed)
    mask = batch["response_mask"]
    trainer.update(
        batch.with_tensors(
            old_logprobs=trainer.compute_logprobs(batch)["old_logprobs"],
            advantages=torch.linspace(-1, 1, len(batch))[:, None] * mask,
        )
    )


def test_moe_sync_holds_and_a_corrupted_expert_is_caught() -> None:
    from workers.train_worker import TrainWorker

    groups = TinyGroups(resolve_model_path("tiny-moe:0"))
    try:
        cfg = tiny_config(
            1,
            model={"path": "tiny-moe:0"},
            rollout={"placement": "separate", "procs_per_node": 1, "cpus_per_proc": 1},
        )
        trainer = groups(cfg, TrainWorker, role="actor")
        rollout = groups(cfg, corrupt_experts.CorruptExpertsRolloutWorker, role="rollout", world=1)
        pool = groups.pool_of(trainer)
        join_weight_group(
            trainer,
            rollout,
            pick_weight_group_spec(trainer, rollout, lambda: pool.find_free_port(0)),
        )
        sync_weights, push_current = build_broadcast_sync(trainer, rollout)
        push_current()
        gaps = {"checkpoint": measure_gap(trainer, rollout, 1)}
        # A dropped expert leaves vLLM reading memory nothing wrote (NaN log-probs, and the
        # engine's cache stays poisoned after the next honest sync): it comes last.
        for step, kind in enumerate([None, "swap", None, "drop"], start=2):
            update(trainer, rollout, step)
            rollout.corrupt_experts(kind)
            sync_weights()
            gaps[f"sync {step - 1} ({kind or 'honest'})"] = measure_gap(trainer, rollout, step)
        print(
            "MoE, separate pools: max |rollout - trainer| log-prob gap: "
            + ", ".join(f"{k} {v:.2e}" for k, v in gaps.items())
        )
        honest = {k: v for k, v in gaps.items() if "swap" not in k and "drop" not in k}
        corrupted = {k: v for k, v in gaps.items() if k not in honest}
        assert all(gap < HEALTHY for gap in honest.values()), honest
        # NaN counts as caught: it compares below nothing, so "not <=" and not ">".
        assert not any(gap <= CORRUPT for gap in corrupted.values()), corrupted
    finally:
        groups.tear_down()
