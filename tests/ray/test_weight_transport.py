"""The cross-process weight transport on a real Ray cluster: a training-only worker broadcasts
its weights over gloo to a rollout-only worker in another pool (``rollout.placement=separate``).

A stale-weight probe: the rollout engine's log-probs of its own samples match the trainer's
before an update, no longer match after an update that was not synced, and match again
after the sync; every row carries the version of the weights it was sampled with. A rollout
worker that dies during a sync is named, and the trainer's outstanding send does not hang it.
"""

from __future__ import annotations

import pytest
import ray
import torch

from rlframe.controller.worker_group import WorkerError, WorkerGroup
from rlframe.run.pools import build_broadcast_sync, join_weight_group, pick_weight_group_spec
from tests.ray.factories import logprob_gap, prompts_for, tiny_config
from tests.rows_grid import generate_batch

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]


def sample(rollout: WorkerGroup, step: int):
    prompts = prompts_for(step)
    return generate_batch(rollout.generate, prompts, 6)


def test_broadcast_sync_moves_the_update_and_stamps_versions(tiny_hybrid_group) -> None:
    from workers.rollout_worker import RolloutWorker
    from workers.train_worker import TrainWorker

    # 1 MiB buckets: the tiny model's 1.2 MB of weights cross in two buckets per sync.
    rollout_keys = {"placement": "separate", "procs_per_node": 1, "cpus_per_proc": 1}
    cfg = tiny_config(1, rollout={**rollout_keys, "weight_sync_bucket_mb": 1})
    trainer = tiny_hybrid_group(cfg, TrainWorker, role="actor")
    rollout = tiny_hybrid_group(cfg, RolloutWorker, role="rollout", world=1)
    train_pool = tiny_hybrid_group.pool_of(trainer)
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
