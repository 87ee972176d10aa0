"""LoRA on a mixture-of-experts model (tiny-moe:0): the adapters go on the attention (the
experts are fused 3-D parameters, no linear layer), the experts and the router stay frozen, and
a merged sync into the hf engine serves the trained policy: the engine's probe log-probs match
the trainer's to fp32 agreement and moved with the update."""

from __future__ import annotations

import pytest

from rlframe.data.tiny_model import resolve_model_path
from tests.workers.cases import build_role, make_batch, make_lora_config

ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}


@pytest.fixture(scope="module")
def moe_path() -> str:
    return resolve_model_path("tiny-moe:0")  # the runs' cache: the e2e MoE tests build it too


def test_attention_adapters_train_and_sync_merged(moe_path: str, one_rank_group: None) -> None:
    from workers.roles.rollout_role import RolloutRole
    from workers.sync.weight_sync import InProcessSink

    cfg = make_lora_config(rank=8)
    cfg.model.path = "tiny-moe:0"
    train = build_role(moe_path, cfg)
    adapted = {
        name.split(".lora_")[0].rsplit(".", 1)[-1]
        for name, p in train.actor.model.named_parameters()
        if p.requires_grad
    }
    assert adapted == ATTENTION
    rollout = RolloutRole(cfg, moe_path, "cpu", 0)
    rollout.verify_weights(train.compute_sync_probe())  # version 0: the base on both sides
    first = rollout.last_probe.logprobs
    for _ in range(3):
        train.update(make_batch())
    version = train.publish_weights()
    probe = train.compute_sync_probe()
    InProcessSink(rollout).push(train.weight_source(), version)
    rollout.verify_weights(probe)
    after = rollout.last_probe.logprobs
    gap, moved = (after - probe.logprobs).abs().max(), (after - first).abs().max()
    print(f"tiny-moe:0 LoRA merged sync: probe gap {float(gap):.3g}, moved {float(moved):.3g}")
    assert float(gap) < 1e-4 < 1e-2 < float(moved)


def test_lora_reference_under_router_replay_routes_freely(
    moe_path: str, one_rank_group: None
) -> None:
    """Desk check item 1 of issue 45: LoRA + algorithm.router_replay=rollout + a KL term. The
    reference is the policy engine with adapters off, whose rows carry no routed experts: it
    scores as a separate reference engine does (its own routing), not by replay, which
    raised at the first reference pass."""
    import torch

    from rlframe.config import AlgorithmConfig

    cfg = make_lora_config(rank=8)
    cfg.model.path = "tiny-moe:0"
    cfg.algorithm = AlgorithmConfig(kl_coef=0.1, router_replay="rollout")
    train = build_role(moe_path, cfg)
    assert train.actor.replay is not None
    batch = make_batch()
    ref = train.compute_ref_logprobs(batch)
    assert train.actor.replay is not None  # replay is back on for the policy's passes
    # Adapters start at zero: the reference is the base, which the policy equals by its own
    # routing too (scored with replay off, as a plain engine would).
    with train.actor.routing_freely():
        policy = train.compute_logprobs(batch)
    mask = batch.response_mask.bool()
    assert torch.isfinite(ref[mask]).all()
    assert torch.equal(ref[mask], policy[mask])
