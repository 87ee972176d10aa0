"""One rank of a real two-process FSDP2 group (gloo) computing a mini-batch's gradient.

Started by :func:`run_two_ranks` (torch.multiprocessing); rank 0 writes what ``compute``
returns for every case to a file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from tests.workers.layout_cases import (
    free_port,
    gather_grads,
    make_batch,
    make_config,
    set_rank_env,
)


def compute_case_grads(
    config_kwargs: dict, model_path: str, rank: int, world_size: int
) -> torch.Tensor:
    """The full gradient of one mini-batch on this rank's share (rows balanced by the
    driver's rule; a sequence-parallel group works on its ranks' shares together)."""
    from rlframe.core.sequence_layout import balance_ranks, count_row_tokens
    from workers.train_worker import TrainWorker
    from workers.training.fsdp import accumulate_gradients

    cfg = make_config(world_size=world_size, **config_kwargs)
    role = TrainWorker(cfg, model_path, "cpu").train_role
    batch = make_batch()
    order = balance_ranks(
        count_row_tokens(batch.prompt_mask, batch.response_mask, packed=True),
        world_size,
        cfg.actor.mini_batch_size,
    )
    share = batch.rows(order).chunk(world_size)[rank]
    role.actor.model.train()
    rows, _ = role.actor.gather_rows(share, block=len(share))
    sp_size = role.actor.sequence_parallel_size
    accumulate_gradients(rows, cfg.actor, "cpu", role.packed, role.forward_backward, sp_size)
    return gather_grads(role.actor.model)


def run_rank(
    rank: int,
    world_size: int,
    port: int,
    model_path: str,
    cases: list[dict],
    out: str,
    compute: Callable[[dict, str, int, int], Any] = compute_case_grads,
) -> None:
    set_rank_env(rank, world_size, port)
    results = [compute(case, model_path, rank, world_size) for case in cases]
    if rank == 0:
        torch.save(results, out)


def run_two_ranks(
    model_path: str,
    cases: list[dict],
    out: str,
    compute: Callable[[dict, str, int, int], Any] = compute_case_grads,
) -> list[Any]:
    """``compute`` of every case on two spawned gloo ranks; rank 0's results, in order."""
    mp.start_processes(
        run_rank,
        args=(2, free_port(), model_path, cases, out, compute),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    results: list[Any] = torch.load(out)
    return results
