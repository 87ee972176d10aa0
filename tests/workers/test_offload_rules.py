"""What ``actor.offload`` moves and what a frozen model holds (desk check item 7). Offload
itself runs on CUDA only (bench/gpu_check.py measures the round trip); its rules are checked
here on a one-rank gloo group: AdamW's step counts never leave the host, and the reference
holds its weights in the compute dtype, not an fp32 master copy it never updates."""

from __future__ import annotations

import pytest
import torch

from rlframe.config import ModelConfig
from workers.training.fsdp import FSDPEngine, OptimizerSpec

SPEC = OptimizerSpec(1e-3, 0.0, 1.0, 0, "constant", 10)


@pytest.mark.usefixtures("one_rank_group")
def test_offload_moves_optimizer_moments_but_not_step_counts(model_path: str) -> None:
    engine = FSDPEngine(model_path, ModelConfig(path=model_path), SPEC, "cpu")
    ids = torch.arange(1, 9)[None]
    engine.model(input_ids=ids, use_cache=False).logits.float().pow(2).mean().backward()
    engine.optimizer_step()
    # "meta" stands for the GPU: a device other than the host that shows what moved.
    engine.move_to("meta")
    states = list(engine.optimizer.state.values())
    assert states and all(s["exp_avg"].device.type == "meta" for s in states)
    assert all(s["step"].device.type == "cpu" for s in states)


@pytest.mark.usefixtures("one_rank_group")
def test_a_frozen_engine_holds_the_compute_dtype(model_path: str) -> None:
    cfg = ModelConfig(path=model_path, dtype="bfloat16")
    reference = FSDPEngine(model_path, cfg, None, "cpu")
    actor = FSDPEngine(model_path, cfg, SPEC, "cpu")
    assert {p.dtype for p in reference.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in actor.model.parameters()} == {torch.float32}
