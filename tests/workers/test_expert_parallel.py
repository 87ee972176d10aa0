"""Expert parallelism in the trainer (``actor.expert_parallel_size``): on two real gloo ranks
(FSDP2 for the dense parameters), the gradient of every parameter of ``tiny-moe:0`` (Qwen3-MoE,
8 experts, top-2) with the experts split over the two ranks (EP 2: four experts each, tokens
sent to their expert's rank and back) equals the gradient of the same mini-batch with every
expert on every rank (EP 1), to a few fp32 ulps. A token sent to the wrong rank, a missing
gradient scale or an expert summed twice moves it by a fraction of its size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlframe.data.tiny_model import resolve_model_path
from tests.workers.cases import assert_same_gradient
from tests.workers.layout_cases import make_batch, make_config
from tests.workers.rank_grads import run_two_ranks

GRADIENT_ULPS = 32
"""Bound on a gradient computed with the experts' outputs summed in another order (the
routing weight applied after the expert, outside it; the ranks' shares added by the
all-to-all's backward), in fp32 ulps of its largest element. Measured: 13.3."""


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return resolve_model_path("tiny-moe:0", cache_dir=tmp_path_factory.mktemp("models"))


def compute_named_grads(
    config_kwargs: dict, model_path: str, rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient after one mini-batch (this rank's share), by name;
    expert-parallel experts are gathered from their ranks, after the step's reduction."""
    from rlframe.core.sequence_layout import balance_ranks, count_row_tokens
    from workers.train_worker import TrainWorker
    from workers.training.fsdp import accumulate_gradients, full_tensor

    cfg = make_config(world_size=world_size, kl_coef=0.0, micro=4, **config_kwargs)
    role = TrainWorker(cfg, model_path, "cpu").train_role
    batch = make_batch()
    order = balance_ranks(
        count_row_tokens(batch.prompt_mask, batch.response_mask, packed=True),
        world_size,
        cfg.actor.mini_batch_size,
    )
    share = batch.rows(order).chunk(world_size)[rank]
    engine = role.actor
    engine.model.train()
    accumulate_gradients(share, cfg.actor, "cpu", role.packed, role.forward_backward, 1)
    plan = engine.ep
    if plan is not None:
        plan.reduce_gradients()
    grads = {}
    for name, param in engine.model.named_parameters():
        assert param.grad is not None, name
        held = plan is not None and plan.holds(param)
        grads[name] = plan.gather(param.grad) if held else full_tensor(param.grad)
    return grads


@pytest.mark.slow
def test_expert_parallel_gives_the_gradient_of_whole_experts(moe_path: str, tmp_path) -> None:
    out = tmp_path / "grads.pt"
    whole, split = run_two_ranks(moe_path, [{"ep": 1}, {"ep": 2}], str(out), compute_named_grads)
    assert whole.keys() == split.keys()
    assert any(".experts." in name for name in whole)
    worst = 0.0
    for name, want in whole.items():
        got = split[name]
        assert got.shape == want.shape, name
        scale = float(want.abs().max())
        worst = max(worst, float((got - want).abs().max()) / scale / torch.finfo().eps)
        assert_same_gradient(got, want, ulps=GRADIENT_ULPS)
    print(f"EP 2 vs EP 1: largest gap {worst:.1f} fp32 ulps over {len(whole)} parameters")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (DTensor) optimizer moment."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def save_and_resume(case: dict, model_path: str, rank: int, world_size: int) -> dict[str, object]:
    """Train one step at EP 2 and save; load that checkpoint at EP 2 and at EP 1: each
    parameter (whole) and each expert's optimizer moments as saved. The saving engine then
    trains on (a save once left DTensor moments in the experts' AdamW state: the next step
    failed)."""
    from workers.train_worker import TrainWorker
    from workers.training.checkpointing import load_engine, save_engine
    from workers.training.fsdp import full_tensor

    def build(ep: int):
        cfg = make_config(world_size=world_size, kl_coef=0.0, micro=4, ep=ep)
        return TrainWorker(cfg, model_path, "cpu").train_role

    def whole(engine) -> dict[str, torch.Tensor]:
        plan = engine.ep
        return {
            name: (plan.gather(p) if plan is not None and plan.holds(p) else full_tensor(p))
            .detach()
            .clone()
            for name, p in engine.model.named_parameters()
        }

    trained = build(2)
    trained.update(make_batch().chunk(world_size)[rank])
    save_engine(trained.actor, Path(case["dir"]) / "actor")
    want = whole(trained.actor)
    moments = {
        i: local(state["exp_avg"]).clone()
        for i, state in enumerate(trained.actor.optimizer.state.values())
    }
    trained.update(make_batch().chunk(world_size)[rank])
    results: dict[str, object] = {"want": want}
    for ep in (2, 1):
        resumed = build(ep)
        load_engine(resumed.actor, Path(case["dir"]) / "actor")
        results[f"ep{ep}"] = whole(resumed.actor)
        if ep == 2:
            got = [local(state["exp_avg"]) for state in resumed.actor.optimizer.state.values()]
            results["moments_equal"] = len(got) == len(moments) and all(
                torch.equal(got[i], v) for i, v in moments.items()
            )
    return results


@pytest.mark.slow
def test_a_checkpoint_at_ep_2_resumes_at_ep_2_and_at_ep_1_and_exports(
    moe_path: str, tmp_path: Path
) -> None:
    """Saved at EP 2, loaded at EP 2 and at EP 1: every parameter (whole) and every AdamW
    moment as saved; exported (one process, DCP reads the experts' slices whole), it loads in
    transformers with the trained weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlframe.state.checkpoint_layout import HF_CONFIG
    from rlframe.state.export import export_checkpoint

    out = tmp_path / "state.pt"
    case = {"dir": str(tmp_path / "ckpt")}
    (result,) = run_two_ranks(moe_path, [case], str(out), save_and_resume)
    assert result["moments_equal"]
    want = result["want"]
    assert any(".experts." in name for name in want)
    for ep in ("ep2", "ep1"):
        for name, tensor in want.items():
            assert torch.equal(result[ep][name], tensor), f"{ep}: {name}"
    checkpoint = Path(case["dir"])
    AutoConfig.from_pretrained(moe_path).save_pretrained(checkpoint / HF_CONFIG)
    AutoTokenizer.from_pretrained(moe_path).save_pretrained(checkpoint / HF_CONFIG)
    exported = AutoModelForCausalLM.from_pretrained(export_checkpoint(checkpoint, tmp_path / "hf"))
    written = exported.state_dict()
    for name, tensor in want.items():
        assert torch.equal(written[name], tensor), f"export: {name}"


def compute_critic_case(case: dict, model_path: str, rank: int, world_size: int) -> dict:
    """A value model (the critic's engine) at ``case["ep"]``: every rank's values of its rows,
    every parameter's gradient of a fixed weighting of them (experts gathered, after the
    step's reduction) and the gradient norm an optimizer step clips by."""
    import torch.distributed as dist

    from rlframe.core.sequence_layout import build_layout
    from tests.workers.sequence_parallel_cases import gather_rows
    from workers.training.fsdp import FSDPEngine, OptimizerSpec, full_tensor

    if not dist.is_initialized():  # as the critic worker joins its group (env: run_rank)
        dist.init_process_group("gloo")
    cfg = make_config(world_size=world_size, kl_coef=0.0, micro=4)
    torch.manual_seed(0)  # the value head's initialisation
    spec = OptimizerSpec(1e-3, 0.0, 1.0, 0, "constant", 10)
    engine = FSDPEngine(
        model_path, cfg.model, spec, "cpu", head="value", expert_parallel_size=case["ep"]
    )
    layout = build_layout(make_batch().chunk(world_size)[rank], packed=True)
    engine.model.train()
    weights = torch.randn(layout.target_ids.shape, generator=torch.Generator().manual_seed(11))

    def backward() -> torch.Tensor:
        values = engine.compute_token_values(layout)
        (values * weights).sum().backward()
        return layout.to_grid(values.detach())

    values = backward()
    plan = engine.ep
    if plan is not None:
        plan.reduce_gradients()
    grads = {
        name: plan.gather(p.grad) if plan is not None and plan.holds(p) else full_tensor(p.grad)
        for name, p in engine.model.named_parameters()
    }
    engine.model.zero_grad(set_to_none=True)
    backward()
    norm, _ = engine.optimizer_step()
    return {"values": gather_rows(values), "grads": grads, "norm": norm}


@pytest.mark.matrix
def test_a_critic_at_ep_2_gives_the_values_and_gradient_of_ep_1(moe_path: str, tmp_path) -> None:
    """``critic.expert_parallel_size``: the value model (transformers' token-classification
    head over the same MoE backbone) at EP 2 gives EP 1's values, gradients and clipped norm."""
    out = tmp_path / "critic.pt"
    whole, split = run_two_ranks(moe_path, [{"ep": 1}, {"ep": 2}], str(out), compute_critic_case)
    assert whole["values"].abs().max() > 1e-2
    torch.testing.assert_close(split["values"], whole["values"], atol=1e-6, rtol=1e-5)
    assert any(".experts." in name for name in whole["grads"])
    worst = 0.0
    for name, want in whole["grads"].items():
        got = split["grads"][name]
        scale = float(want.abs().max())
        worst = max(worst, float((got - want).abs().max()) / scale / torch.finfo().eps)
        assert_same_gradient(got, want, ulps=GRADIENT_ULPS)
    assert split["norm"] == pytest.approx(whole["norm"], rel=1e-6)
    print(f"critic EP 2 vs EP 1: largest gradient gap {worst:.1f} fp32 ulps")
