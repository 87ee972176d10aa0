"""Routing replay (R3) from the ``hf`` rollout engine to the FSDP2 trainer, on a tiny MoE.

The rollout samples in bf16 and the trainer scores in fp32, as a bf16 engine and an fp32
master copy do on a GPU: bf16 rounding moves some tokens' router logits across the top-2
boundary, so the trainer's own routing differs from the rollout's. An fp32 rollout agrees on
every (token, layer) here, which would test nothing, and ``tiny-moe:0`` in bf16 flips under 1%
of them. So the routers are built with near ties on purpose (:func:`build_near_tie_moe`):
about one pair in eight flips, and the gap that replay closes stands far above bf16 noise.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from rlframe.config import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    TrainerConfig,
)
from rlframe.core.protocol import Batch
from rlframe.core.sequence_layout import build_layout
from rlframe.core.train_batch import POLICY_UPDATE, TrainBatch
from rlframe.data.tiny_model import resolve_model_path
from rlframe.models.moe_routing import compute_routing_agreement
from tests.rows_grid import generate_batch
from tests.workers.layout_cases import gather_grads

pytestmark = pytest.mark.usefixtures("one_rank_group")

ROWS, PROMPT, RESPONSE = 8, 16, 6
TIE_SPREAD = 0.03
"""How far apart the experts' router rows are, relative to ``tiny-moe:0``'s (1: as built)."""


def make_replay_config(dtype: str, packed: bool = False) -> Config:
    return Config(
        model=ModelConfig(path="tiny-moe:0", dtype=dtype),
        data=DataConfig(batch_size=2, max_prompt_length=PROMPT),
        rollout=RolloutConfig(engine="hf", n=4, max_tokens=RESPONSE),
        actor=ActorConfig(mini_batch_size=ROWS, micro_batch_size=ROWS, pack_sequences=packed),
        algorithm=AlgorithmConfig(router_replay="rollout"),
        trainer=TrainerConfig(total_steps=1, device="cpu"),
    )


def make_prompts() -> TrainBatch:
    """ROWS left-padded prompts of PROMPT / 2 to PROMPT random tokens."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(PROMPT // 2, PROMPT + 1, (ROWS,), generator=g)
    mask = (torch.arange(PROMPT)[None] >= PROMPT - lengths[:, None]).long()
    ids = torch.randint(3, 52, (ROWS, PROMPT), generator=g) * mask
    return Batch(
        {"prompt_ids": ids, "prompt_mask": mask},
        {"seed": list(range(ROWS))},  # a column, as the prompt loader makes it
        meta={"pad_token_id": 0, "stop_token_ids": [1]},
    )


def build_near_tie_moe(source: str, target: Path) -> str:
    """``source`` with each router's expert rows moved close together: a shared row plus
    TIE_SPREAD times its own. The experts' logits then differ by little next to their common
    part, whose bf16 rounding decides the top-2 for many tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.model_hooks.router_replay import find_routers

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in find_routers(model):
            shared = torch.randn(router.weight.shape[1], generator=g) * router.weight.std()
            router.weight.copy_(shared + TIE_SPREAD * router.weight)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return str(target)


@pytest.fixture(scope="module")
def replay_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainBatch, Any, str]:
    """(a batch sampled by a bf16 ``hf`` engine that records routing, an fp32 TrainRole with
    router replay on, the model's path)."""
    from workers.roles.rollout_role import RolloutRole
    from workers.roles.train_role import TrainRole

    models = tmp_path_factory.mktemp("models")
    path = build_near_tie_moe(resolve_model_path("tiny-moe:0", cache_dir=models), models / "tie")
    rollout = RolloutRole(make_replay_config("bfloat16"), path, "cpu", 0)
    # The single_turn agent's path: prompt rows -> the engine call's wire -> the grid.
    batch = POLICY_UPDATE.build(generate_batch(rollout.generate, make_prompts(), RESPONSE))
    return batch, TrainRole(make_replay_config("float32"), path, "cpu", 1), path


def mean_gap(logprobs: torch.Tensor, batch: TrainBatch) -> float:
    mask = batch.loss_mask.bool()
    return float((logprobs - batch.rollout_logprobs).abs()[mask].mean())


def test_replay_routes_the_trainer_as_the_rollout(replay_case: tuple[TrainBatch, Any, str]) -> None:
    from workers.model_hooks.router_replay import RoutingRecorder
    from workers.training.layout_forward import compute_layout_logprobs

    batch, train, _ = replay_case
    rollout_routing = batch.routed_experts
    assert rollout_routing.shape[:2] == (ROWS, PROMPT + RESPONSE)
    # Every real token but each response's last one was recorded.
    recorded = (rollout_routing >= 0).all(-1).all(-1)
    real = torch.cat([batch.prompt_mask, batch.response_mask], 1).bool()
    assert int(recorded.sum()) == int(real.sum()) - ROWS
    model = train.actor.model
    # Registered after the replay hooks: it records the experts the forward really used.
    used = RoutingRecorder(model)
    try:
        free_rows = replace(batch, routed_experts=None)
        layout = build_layout(free_rows, packed=False)
        with torch.no_grad():
            free = layout.to_grid(compute_layout_logprobs(model, layout, 1.0, 0, False).logprobs)
        free_routing = used.take().view(rollout_routing.shape)
        replayed = train.compute_logprobs(batch)  # the worker's old-log-prob pass
        replayed_routing = used.take().view(rollout_routing.shape)
    finally:
        used.remove()
    agreement = compute_routing_agreement(rollout_routing, free_routing)
    free_gap, replay_gap = mean_gap(free, batch), mean_gap(replayed, batch)
    print(
        f"routing agreement without replay {agreement:.4f}; "
        f"lp_diff without replay {free_gap:.3e}, with replay {replay_gap:.3e}"
    )
    assert agreement < 1, "the bf16 rollout routed every token as the fp32 trainer: no test"
    assert torch.equal(replayed_routing[recorded], rollout_routing[recorded])
    assert replay_gap <= free_gap


def score_with_grads(engine: Any, batch: TrainBatch, packed: bool, chunk: int):
    """Log-probs [B, R] and all gradients of a random-weighted sum of them."""
    layout = build_layout(batch, packed)
    logprobs = layout.to_grid(engine.compute_token_logprobs(layout, 1.0, chunk, False).logprobs)
    g = torch.Generator().manual_seed(5)
    (torch.randn(logprobs.shape, generator=g) * logprobs).sum().backward()
    grads = gather_grads(engine.model)
    engine.model.zero_grad(set_to_none=True)
    return logprobs.detach(), grads


@pytest.mark.parametrize("chunk", [0, 4])
def test_replay_packed_equals_padded(replay_case: tuple[TrainBatch, Any, str], chunk: int) -> None:
    from workers.model_hooks.router_replay import find_routers

    batch, train, _ = replay_case
    engine = train.actor
    padded, padded_grads = score_with_grads(engine, batch, packed=False, chunk=chunk)
    packed, packed_grads = score_with_grads(engine, batch, packed=True, chunk=chunk)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_grads, padded_grads, atol=1e-5, rtol=1e-5)
    # The replayed experts' weights come from the router's logits: the router learns.
    layout = build_layout(batch, packed=True)
    logprobs = engine.compute_token_logprobs(layout, 1.0, chunk, False).logprobs
    logprobs.sum().backward()
    for router in find_routers(engine.model):
        assert float(router.weight.grad.full_tensor().abs().sum()) > 0
    engine.model.zero_grad(set_to_none=True)


def test_replay_holds_under_gradient_checkpointing(
    replay_case: tuple[TrainBatch, Any, str],
) -> None:
    # The backward re-runs each layer's forward, routers included: the update replays there
    # too, or the recomputation routes differently from the forward it stands in for.
    from rlframe.algorithms.losses import LossScale
    from workers.roles.train_role import TrainRole

    batch, train, path = replay_case
    g = torch.Generator().manual_seed(3)
    rows = replace(
        batch,
        advantages=torch.randn(ROWS, 1, generator=g) * batch.loss_mask,
        old_logprobs=batch.rollout_logprobs,
    )
    scale = LossScale(tokens=float(rows.loss_mask.sum()), sequences=float(ROWS))
    cfg = make_replay_config("float32")
    cfg.model.gradient_checkpointing = True
    grads = []
    for role in (train, TrainRole(cfg, path, "cpu", 1)):
        role.actor.model.train()  # transformers checkpoints in training mode only
        role.forward_backward(rows, scale)
        grads.append(gather_grads(role.actor.model))
        role.actor.model.zero_grad(set_to_none=True)
        role.actor.model.eval()
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-6)
