"""The cross-process weight transport on a real Ray cluster: a training-only worker broadcasts
its weights over gloo to a rollout-only worker in another pool (``rollout.placement=separate``).

A stale-weight probe: the rollout engine's log-probs of its own samples match the trainer's
before an update, no longer match after an update that was not synced, and match again
after the sync; every row carries the version of the weights it was sampled with. A rollout
worker that dies during a sync is named, and the trainer's outstanding send does not hang it.
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
from rlframe.controller.placement import ResourcePool
from rlframe.controller.worker_group import WorkerError, WorkerGroup
from rlframe.data.tiny_model import resolve_model_path
from rlframe.launch import worker_env
from rlframe.pools import build_broadcast_sync, join_weight_group, pick_weight_group_spec
from tests.ray.factories import logprob_gap, prompts_for

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]


def make_config() -> Config:
    return Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=4, max_prompt_length=16),
        # 1 MiB buckets: the tiny model's 1.2 MB of weights cross in two buckets per sync.
        rollout=RolloutConfig(
            n=4,
            max_tokens=6,
            cpu_kv_cache_gb=1,
            weight_sync_bucket_mb=1,
            placement="separate",
            procs_per_node=1,
            cpus_per_proc=1,
        ),
        actor=ActorConfig(lr=1e-2, mini_batch_size=16, micro_batch_size=16),
        trainer=TrainerConfig(total_steps=1, procs_per_node=1, device="cpu"),
    )


def start_group(cfg: Config, cls_path: str, role: str, model_path: str) -> tuple:
    pool = ResourcePool(
        nnodes=1, procs_per_node=1, device="cpu", cpus_per_proc=1, name=f"test_{role}"
    )
    pool.create(timeout_s=60)
    module, name = cls_path.rsplit(".", 1)
    cls = getattr(__import__(module, fromlist=[name]), name)
    group = WorkerGroup(
        pool,
        cls,
        role=role,
        init_args=(cfg, model_path, "cpu"),
        call_timeout_s=600,
        env=worker_env(cfg, "cpu"),
    )
    return pool, group


def sample(rollout: WorkerGroup, step: int):
    prompts = prompts_for(step)
    return prompts.union(rollout.generate(prompts))


def test_broadcast_sync_moves_the_update_and_stamps_versions(tmp_path: Path) -> None:
    cfg = make_config()
    model_path = resolve_model_path("tiny:0", cache_dir=tmp_path)
    started = []
    try:
        train_pool, trainer = start_group(
            cfg, "workers.train_worker.TrainWorker", "actor", model_path
        )
        started.append((train_pool, trainer))
        roll_pool, rollout = start_group(
            cfg, "workers.rollout_worker.RolloutWorker", "rollout", model_path
        )
        started.append((roll_pool, rollout))
        join_weight_group(
            trainer,
            rollout,
            pick_weight_group_spec(trainer, rollout, lambda: train_pool.find_free_port(0)),
        )
        sync_weights, push_current = build_broadcast_sync(trainer, rollout)
        assert push_current() == 0

        batch = sample(rollout, 1)
        assert batch["weights_version"].tolist() == [0] * len(batch)
        before = trainer.compute_logprobs(batch)["old_logprobs"]
        gap_fresh = logprob_gap(batch, before)

        # One update with a strong signal moves the trainer's weights, not the engine's.
        mask = batch["response_mask"]
        trainer.update(
            batch.with_tensors(
                old_logprobs=before, advantages=torch.linspace(-1, 1, len(batch))[:, None] * mask
            )
        )
        stale = sample(rollout, 3)
        gap_stale = logprob_gap(stale, trainer.compute_logprobs(stale)["old_logprobs"])
        assert stale["weights_version"].tolist() == [0] * len(stale)

        assert sync_weights() == 1
        synced = sample(rollout, 2)
        gap_synced = logprob_gap(synced, trainer.compute_logprobs(synced)["old_logprobs"])
        assert synced["weights_version"].tolist() == [1] * len(synced)
        print(
            f"separate pools: max |rollout - trainer| log-prob gap: fresh {gap_fresh:.2e}, "
            f"stale (update not synced) {gap_stale:.2e}, after the broadcast {gap_synced:.2e}"
        )
        assert gap_fresh < 1e-4 and gap_synced < 1e-4
        assert gap_stale > 1e-3, "an update that was not synced must show in the log-prob gap"

        # A rollout rank that dies ends the sync with its name, while the trainer's send is
        # still blocked in the broadcast.
        ray.kill(rollout.actors[0], no_restart=True)
        with pytest.raises(WorkerError) as failure:
            sync_weights()
        assert failure.value.role == "rollout" and failure.value.method == "receive_weights"
        assert failure.value.rank == 0
    finally:
        for pool, group in reversed(started):
            group.shutdown()
            pool.remove()
