"""The training loop's entry: bring up Ray and the workers' resource pool, then train.

NOTE: the hybrid workers and ``Trainer.step()`` (generate -> reward -> log-probs ->
advantage -> update -> weight sync) are the next piece of work; until they land this entry
brings the cluster and placement up, reports them, and stops with a clear message.
"""

from __future__ import annotations

import sys

from rlframe.config import Config
from rlframe.controller.cluster import init_ray, resolve_device


def run_training(cfg: Config) -> None:
    """Start or join Ray, place one bundle per worker process, and run the loop."""
    started = init_ray(cfg.ray)
    import ray

    from rlframe.controller.placement import ResourcePool

    try:
        device = resolve_device(cfg.trainer.device)
        pool = ResourcePool(
            nnodes=cfg.trainer.nnodes,
            procs_per_node=cfg.trainer.procs_per_node,
            device=device,
            cpus_per_proc=cfg.trainer.cpus_per_proc,
            name="actor_rollout",
        )
        pool.create()
        print(
            f"rlframe: Ray up ({'started locally' if started else 'joined'}), "
            f"{pool.world_size} {device} bundle(s) placed: {pool.bundle()} each",
            flush=True,
        )
        pool.remove()
        sys.exit("rlframe: the training loop (hybrid workers, GRPO) is not built yet; see issue 3")
    finally:
        if started:
            ray.shutdown()
