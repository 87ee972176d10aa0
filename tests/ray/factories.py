"""What the Ray-tier tests of the real workers build: the tiny model's config, worker groups
on it (through the ``tiny_hybrid_group`` fixture of tests/ray/conftest.py), prompts, and the
log-prob gap between the rollout engine and the trainer."""

from __future__ import annotations

from typing import Any, get_type_hints

import torch

from rlframe.config import Config
from rlframe.controller.placement import ResourcePool
from rlframe.controller.worker_group import WorkerGroup
from rlframe.core.protocol import Batch
from rlframe.data.loader import build_prompt_batch
from rlframe.data.prompts import load_prompt_records
from rlframe.data.tiny_model import build_tiny_tokenizer


def tiny_config(world: int = 1, **sections: dict[str, Any]) -> Config:
    """The tiny model on ``world`` CPU ranks: 4 prompts x 4 samples of at most 6 tokens, one
    mini-batch of 16 split evenly over the ranks, a 1 GiB KV cache, lr 1e-2 (one update
    visibly moves the policy). ``sections`` change single fields of a section, e.g.
    ``rollout={"engine": "hf"}``."""
    tree: dict[str, dict[str, Any]] = {
        "model": {"path": "tiny:0"},
        "data": {"batch_size": 4, "max_prompt_length": 16},
        "rollout": {"n": 4, "max_tokens": 6, "cpu_kv_cache_gb": 1},
        "actor": {"lr": 1e-2, "mini_batch_size": 16, "micro_batch_size": 16 // world},
        "trainer": {"total_steps": 1, "procs_per_node": world, "device": "cpu"},
    }
    for name, values in sections.items():
        tree[name] = tree.get(name, {}) | values
    section_types = get_type_hints(Config)
    return Config(**{name: section_types[name](**values) for name, values in tree.items()})


class TinyGroups:
    """Builds worker groups of the real workers on the tiny model as the launcher does (one
    CPU per rank, the launcher's worker environment, ``cfg``'s rollout TP size), each in a
    pool of its own, and tears them down, latest first."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self.made: list[tuple[ResourcePool, WorkerGroup | None]] = []

    def __call__(
        self, cfg: Config, worker_cls: type | None = None, *, role: str = "actor", world: int = 0
    ) -> WorkerGroup:
        """A group of ``worker_cls`` (default :class:`workers.hybrid.HybridWorker`) with
        ``world`` ranks (default ``cfg.trainer.procs_per_node``), started with ``cfg``."""
        from rlframe.run.launch import worker_env

        if worker_cls is None:
            from workers.hybrid import HybridWorker

            worker_cls = HybridWorker
        pool = ResourcePool(
            nnodes=1,
            procs_per_node=world or cfg.trainer.procs_per_node,
            device="cpu",
            cpus_per_proc=1,
            name=f"test_{role}_{len(self.made)}",
        )
        pool.create(timeout_s=60)
        self.made.append((pool, None))  # removed even when the group fails to start
        group = WorkerGroup(
            pool,
            worker_cls,
            role=role,
            init_args=(cfg, self.model_path, "cpu"),
            call_timeout_s=600,
            env=worker_env(cfg, "cpu"),
            rollout_tp_size=cfg.rollout.tensor_parallel_size,
        )
        self.made[-1] = (pool, group)
        return group

    def pool_of(self, group: WorkerGroup) -> ResourcePool:
        """The pool ``group`` was placed in."""
        return next(pool for pool, made in self.made if made is group)

    def tear_down(self) -> None:
        for pool, group in reversed(self.made):
            if group is not None:
                group.shutdown()
            pool.remove()
        self.made = []


def prompts_for(seed: int, n: int = 4, task: str = "arithmetic", tokenizer: Any = None) -> Batch:
    """4 prompts of ``task`` x ``n`` samples, seeded by ``seed``, with the stop and pad ids the
    engines need, tokenized by ``tokenizer`` (default: the tiny model's, as built in memory;
    pass the one loaded from the model folder where the test renders turns with it, as the
    two split some texts differently)."""
    tok = tokenizer or build_tiny_tokenizer()
    records = load_prompt_records([], task, tok, 16, seed=seed, synthetic_size=4)
    batch = build_prompt_batch(
        records, n=n, first_group=0, pad_token_id=tok.pad_token_id, seed=seed
    )
    batch.meta |= {"stop_token_ids": [tok.eos_token_id], "pad_token_id": tok.pad_token_id}
    return batch


def logprob_gap(batch: Batch, trainer_logprobs: torch.Tensor) -> float:
    """The largest |rollout - trainer| log-prob over the batch's response tokens."""
    mask = batch["response_mask"]
    return float(((batch["rollout_logprobs"] - trainer_logprobs).abs() * mask).max())
