"""One rank's figures for a sequence-parallel case: the token log-probs of the batch, one
mini-batch's gradient, and what an update of two optimizer steps applied and left (an MoE
model's load-balancing loss: tests/workers/router_loss_cases.py).

Run on each rank of a real two-process gloo group by tests/workers/test_sequence_parallel.py
(through :func:`tests.workers.rank_grads.run_rank`), once with ``sp=1`` and once with ``sp=2``
for the same case: the two must agree.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.workers.cases import record_step_grads
from tests.workers.layout_cases import make_batch, make_config


def gather_rows(values: torch.Tensor) -> torch.Tensor:
    """Every rank's rows, in rank order."""
    parts = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, values.contiguous())
    return torch.cat(parts)


def gather_trainable(model: torch.nn.Module, attr: str | None = None) -> torch.Tensor:
    """The trainable parameters (or their ``.grad`` with ``attr="grad"``) as one flat vector
    of full tensors."""
    from workers.training.fsdp import full_tensor

    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat([full_tensor(getattr(p, attr) if attr else p).reshape(-1) for p in params])


def gather_optimizer_state(engine) -> dict[str, torch.Tensor]:  # engine: FSDPEngine
    from workers.training.fsdp import full_tensor

    state = [engine.optimizer.state[p] for p in engine.trainable]
    return {
        key: torch.cat([full_tensor(s[key]).reshape(-1).float() for s in state])
        for key in ("step", "exp_avg", "exp_avg_sq")
    }


def compute_values(cfg, model: str, share, packed: bool) -> torch.Tensor:
    """[rows, R] a value model's values of this rank's rows (the critic's engine; its
    value head initialised from the same seed in every run)."""
    from workers.roles.train_role import score_micro_batches
    from workers.training.fsdp import FSDPEngine

    torch.manual_seed(0)
    engine = FSDPEngine(
        model, cfg.model, None, "cpu", head="value",
        sequence_parallel_size=cfg.actor.sequence_parallel_size,
    )  # fmt: skip
    return score_micro_batches(engine, share, cfg.actor, packed, engine.compute_token_values)


def compute_sequence_parallel_case(
    case: dict, model_path: str, rank: int, world_size: int
) -> dict[str, torch.Tensor | dict[str, float]]:
    """Log-probs [16, R] (rows in the balanced order), the gradient of one mini-batch, and
    of ``update`` (mini-batches of 8 rows: two optimizer steps) the gradient each step
    applied, the metrics and the optimizer state."""
    from rlframe.core.sequence_layout import balance_ranks, count_row_tokens
    from workers.train_worker import TrainWorker
    from workers.training.fsdp import accumulate_gradients

    case = dict(case)
    model = case.pop("model", model_path)
    with_values = case.pop("values", False)
    cfg = make_config(world_size=world_size, mini=8, lr=1e-3, **case)
    torch.manual_seed(0)  # the LoRA adapters' initialisation
    role = TrainWorker(cfg, model, "cpu").train_role
    batch = make_batch()
    order = balance_ranks(
        count_row_tokens(batch.prompt_mask, batch.response_mask, packed=True), world_size, 8
    )
    share = batch.rows(order).chunk(world_size)[rank]
    out: dict[str, torch.Tensor | dict[str, float]] = {}
    out["logprobs"] = gather_rows(role.compute_logprobs(share))

    role.actor.model.train()
    rows, _ = role.actor.gather_rows(share, block=4)
    sp = role.actor.sequence_parallel_size
    # The first mini-batch: a rank's first 4 rows, or the group's first 4 of each rank.
    first = rows.rows(slice(0, 4 * sp))
    accumulate_gradients(first, cfg.actor, "cpu", role.packed, role.forward_backward, sp)
    out["grads"] = gather_trainable(role.actor.model, "grad")
    role.actor.optimizer.zero_grad(set_to_none=True)

    if with_values:
        out["values"] = gather_rows(compute_values(cfg, model, share, role.packed))
    with record_step_grads(role.actor.optimizer) as steps:
        metrics = role.update(share).metrics
    out["step_grads"] = torch.stack(steps)
    # The driver's view: each metric averaged over the ranks.
    names = sorted(k for k, v in metrics.items() if isinstance(v, float))
    values = torch.tensor([metrics[k] for k in names], dtype=torch.float64)
    dist.all_reduce(values)
    out["metrics"] = dict(zip(names, (values / world_size).tolist()))
    out |= gather_optimizer_state(role.actor)
    return out
