"""The routers' terms of an MoE policy on several ranks against one rank: the load-balancing
loss of a micro-step (every rank's micro-batch together) and routing replay.

:func:`compute_router_loss_case` runs on each rank of a real two-process gloo group (through
:func:`tests.workers.rank_grads.run_rank`): one mini-batch of 8 rows (4 a rank, or a sequence
group's 8 rows) whose only loss term is the load-balancing loss (zero advantages, no KL or
entropy term), and returns every parameter's gradient (expert-parallel experts gathered), the
reported ``actor/router_aux_loss`` per micro-step and which rows each micro-step held on all
ranks together. :func:`compute_single_rank_router_loss` computes the same on one plain
transformers model in the test's process: one micro-batch per micro-step holding the union of
the ranks' rows. With ``replay`` the rows carry random routing (``routed_experts``) and the
rank also reports whether its routers used it.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from rlframe.core.names import RouterReplay
from rlframe.core.train_batch import TrainBatch
from tests.workers.layout_cases import PROMPT, RESPONSE, ROWS, make_batch, make_config

MINI = 8
"""Rows of the mini-batch over all ranks."""


def make_router_loss_batch(layers: int = 2, experts: int = 8, top_k: int = 2) -> TrainBatch:
    """:func:`make_batch` with zero advantages, a ``row_index`` and random routing: distinct
    experts per token-layer, -1 on padding and on each response's last token (never fed)."""
    batch = make_batch()
    g = torch.Generator().manual_seed(7)
    routing = torch.rand(ROWS, PROMPT + RESPONSE, layers, experts, generator=g).argsort(-1)
    routing = routing[..., :top_k].to(torch.int16)
    real = torch.cat([batch.prompt_mask, batch.response_mask], 1).bool()
    lengths = batch.response_mask.sum(1).long()
    for row, length in enumerate(lengths.tolist()):
        if length:
            real[row, PROMPT + length - 1] = False
    routing[~real] = -1
    return replace(
        batch,
        advantages=batch.advantages * 0,
        row_index=torch.arange(ROWS),
        routed_experts=routing,
    )


def compute_router_loss_case(
    case: dict, model_path: str, rank: int, world_size: int
) -> dict[str, object]:
    """See the module docstring; ``case`` holds :func:`make_config`'s keywords and
    ``replay`` (bool)."""
    from rlframe.core.sequence_layout import balance_ranks, build_layout, count_row_tokens
    from workers.model_hooks.router_replay import RoutingRecorder
    from workers.train_worker import TrainWorker
    from workers.training.fsdp import accumulate_gradients, full_tensor

    case = dict(case)
    replay = case.pop("replay", False)
    cfg = make_config(world_size=world_size, mini=MINI, kl_coef=0.0, entropy_coef=0.0, **case)
    cfg.algorithm.router_aux_loss_coef = 1.0
    if replay:
        cfg.algorithm.router_replay = RouterReplay.rollout
    role = TrainWorker(cfg, model_path, "cpu").train_role
    batch = make_router_loss_batch()
    if not replay:
        batch = replace(batch, routed_experts=None)
    costs = count_row_tokens(batch.prompt_mask, batch.response_mask, packed=True)
    order = balance_ranks(costs, world_size, MINI)
    share = batch.rows(order).chunk(world_size)[rank].rows(slice(0, MINI // world_size))
    engine = role.actor
    engine.model.train()
    rows, _ = engine.gather_rows(share, block=len(share))
    used = RoutingRecorder(engine.model)  # after the replay hooks: what the routers sent on
    steps: list[list[int]] = []
    replayed_exactly = True

    def forward_backward(micro, scale):  # (TrainBatch, LossScale) -> metrics
        steps.append(micro.row_index.tolist())
        metrics = role.forward_backward(micro, scale)
        if replay:
            nonlocal replayed_exactly
            target = build_layout(micro, role.packed).flat_routed_experts()
            got = used.take()[: target.shape[0]]  # the forward's (checkpointing re-runs none)
            recorded = (target >= 0).all(-1)
            replayed_exactly &= bool(torch.equal(got[recorded], target[recorded]))
        used.clear()
        return metrics

    sp = engine.sequence_parallel_size
    metrics = accumulate_gradients(rows, cfg.actor, "cpu", role.packed, forward_backward, sp)
    used.remove()
    plan = engine.ep
    if plan is not None:
        plan.reduce_gradients()
    grads = {
        name: (plan.gather(p.grad) if plan is not None and plan.holds(p) else full_tensor(p.grad))
        for name, p in engine.model.named_parameters()
    }
    every_rank: list[list[list[int]]] = [[] for _ in range(world_size)]
    dist.all_gather_object(every_rank, steps)
    # Micro-step i: every rank's i-th micro-batch (a sequence group's ranks hold the same rows).
    micro_steps = [sorted({r for rows in step for r in rows}) for step in zip(*every_rank)]
    routing = {k: v for k, v in metrics.items() if k.startswith("moe/")}
    return {
        "grads": grads,
        "aux": metrics["actor/router_aux_loss"],
        "routing": routing,
        "steps": micro_steps,
        "replayed_exactly": replayed_exactly,
    }


def compute_single_rank_router_loss(
    model_path: str, steps: list[list[int]], packed: bool
) -> tuple[dict[str, torch.Tensor], list[float], dict[str, list[float]]]:
    """Every parameter's gradient of the load-balancing loss (coefficient 1) of one rank
    running ``steps`` (row indices of :func:`make_router_loss_batch`) as its micro-batches of
    one mini-batch, each weighted by its rows over the mini-batch's, on a plain transformers
    model; each micro-batch's loss, and its expert-load metrics. No replay: the routers
    choose."""
    from transformers import AutoModelForCausalLM

    from rlframe.algorithms.router import compute_load_balancing_loss, summarize_routing
    from rlframe.core.sequence_layout import build_layout
    from workers.model_hooks.router_logits import find_router_spec, record_router_logits
    from workers.training.layout_forward import compute_layout_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    spec = find_router_spec(model)
    assert spec is not None
    batch = make_router_loss_batch()
    batch = replace(batch, routed_experts=None)
    mini = sorted({r for step in steps for r in step})
    sequences = int((batch.loss_mask[mini].sum(1) > 0).sum())
    losses: list[float] = []
    routing: dict[str, list[float]] = {}
    for step in steps:
        layout = build_layout(batch.rows(step), packed)
        with record_router_logits(model, spec) as logits:
            compute_layout_logprobs(model, layout, 1.0, 0, False)
        if layout.attention_mask is not None:
            mask = layout.attention_mask.reshape(-1)
        else:
            mask = torch.ones(logits[0].shape[0])
        aux = compute_load_balancing_loss(logits, spec.top_k, mask)
        (aux * len(step) / sequences).backward()
        losses.append(float(aux.detach()))
        for key, value in summarize_routing(logits, spec.top_k, mask).items():
            routing.setdefault(key, []).append(value)
    grads = {
        name: torch.zeros_like(p) if p.grad is None else p.grad
        for name, p in model.named_parameters()
    }
    return grads, losses, routing
