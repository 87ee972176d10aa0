"""The one weight mapping on a mixture-of-experts model (``tiny-moe:0``, Qwen3-MoE): what the
weight sync sends is, name for name and value for value, what the model's checkpoint holds
(per-expert tensors, though transformers holds the experts fused); an exported checkpoint is
written the same way and loads back into transformers with the trained weights."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlframe.data.tiny_model import MOE_EXPERTS, resolve_model_path
from rlframe.state.checkpoint_layout import HF_CONFIG
from workers.model_hooks.weight_names import CheckpointLayout, ModelSlots
from workers.sync.weight_sync import iter_full_tensors


@pytest.fixture(scope="module")
def moe_path() -> Path:
    return Path(resolve_model_path("tiny-moe:0"))


def load_model(path: Path | str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_sync_sends_each_expert_as_the_checkpoint_holds_it(moe_path: Path) -> None:
    model = load_model(moe_path)
    assert model.model.layers[0].mlp.experts.gate_up_proj.ndim == 3  # fused in memory
    sent = dict(iter_full_tensors(model))
    on_disk = load_file(moe_path / "model.safetensors")
    # The tied head is not saved; the sync sends it under its own name (DESIGN.md).
    assert set(sent) == set(on_disk) | {"lm_head.weight"}
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in sent
    for name, tensor in on_disk.items():
        # Values, not only shapes: hidden and expert width are both 128 here, so a swapped
        # gate/up half or a transposed down projection keeps every shape.
        assert torch.equal(sent[name], tensor), name


def test_an_engine_holding_the_fused_model_loads_the_sent_experts(moe_path: Path) -> None:
    """The hf engine holds the transformers model: each per-expert tensor the sync sends lands
    in its expert's slice of the fused parameters, and nothing else is touched."""
    source, target = load_model(moe_path), load_model(moe_path)
    with torch.no_grad():
        for param in source.parameters():
            param.add_(torch.randn_like(param))
        slots = ModelSlots(target)
        for name, tensor in iter_full_tensors(source):
            slots.load(name, tensor)
    for (name, want), got in zip(source.state_dict().items(), target.state_dict().values()):
        assert torch.equal(want, got), name
    with pytest.raises(KeyError):
        slots.load("model.layers.0.mlp.experts.0.w9.weight", torch.zeros(1))


def test_wrapper_segments_are_dropped_before_the_layout(moe_path: Path) -> None:
    model = load_model(moe_path)
    layout = CheckpointLayout(model)
    fused = model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    split = dict(
        layout.to_engine_tensors("_orig_mod.model.layers.0.mlp.experts.gate_up_proj", fused)
    )
    assert len(split) == 2 * MOE_EXPERTS
    # transformers computes ``gate, up = (x @ gate_up[e].T).chunk(2, dim=-1)``.
    assert torch.equal(
        split["model.layers.0.mlp.experts.3.up_proj.weight"], fused[3, fused.shape[1] // 2 :]
    )


def test_export_writes_per_expert_names_that_load_back(moe_path: Path, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoTokenizer

    from rlframe.state.export import export_checkpoint

    trained = load_model(moe_path)
    with torch.no_grad():  # stands in for training: every expert moves, differently
        g = torch.Generator().manual_seed(1)
        for p in trained.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    checkpoint = tmp_path / "step_00000001"
    # The actor's layout of a checkpoint (workers/training/checkpointing.py), on one process.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": trained.state_dict()}, checkpoint_id=str(checkpoint / "actor"))
    AutoConfig.from_pretrained(moe_path).save_pretrained(checkpoint / HF_CONFIG)
    AutoTokenizer.from_pretrained(moe_path).save_pretrained(checkpoint / HF_CONFIG)

    out = export_checkpoint(checkpoint, tmp_path / "hf")
    header = json.loads((out / "config.json").read_text())
    assert header["model_type"] == "qwen3_moe"
    written = load_file(out / "model.safetensors")
    assert set(written) == set(load_file(moe_path / "model.safetensors"))
    layout = CheckpointLayout(trained)
    for name, value in trained.state_dict().items():
        for engine_name, tensor in layout.to_engine_tensors(name, value):
            if engine_name != "lm_head.weight":
                assert torch.equal(written[engine_name], tensor), engine_name
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        assert torch.equal(load_model(out)(ids).logits, trained(ids).logits)
