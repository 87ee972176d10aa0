"""``model.lora``: defaults, value checks, the adapter-sync engine check, unknown target
modules and what a mixture-of-experts model takes, each a config error that names its key
and exits (status 2) before Ray starts."""

from __future__ import annotations

import pytest

from rlframe.config import ConfigError
from rlframe.config.device import will_train_on_cuda
from rlframe.config.lora import LoraConfig, LoraSync
from rlframe.data.tiny_model import resolve_model_path
from rlframe.data.tiny_vl_model import resolve_tiny_vl_path
from rlframe.models.checks import check_vision
from rlframe.models.hf_config import read_model_config
from rlframe.models.lora_targets import (
    check_lora_targets,
    list_peft_targets,
    read_decoder_linears,
    read_model_linears,
)
from tests.unit.cli_errors import check_config_error
from tests.unit.config_trees import build


def test_lora_is_off_by_default_and_parsed_when_set() -> None:
    cfg = build()
    assert not cfg.model.lora.enabled and cfg.model.lora.rank == 0
    assert not cfg.critic.lora.enabled
    cfg = build(model={"path": "tiny:0", "lora": {"rank": 16, "alpha": 32, "sync": "adapter"}})
    assert cfg.model.lora.enabled and cfg.model.lora.sync is LoraSync.adapter
    assert cfg.model.lora.target_modules == []


@pytest.mark.parametrize(
    "lora,match",
    [
        ({"rank": -1}, "model.lora.rank: must be >= 0"),
        ({"rank": 8, "alpha": 0}, "model.lora.alpha: must be > 0"),
        ({"rank": 8, "dropout": 1.0}, r"model.lora.dropout: must be in \[0, 1\)"),
        ({"rank": 8, "target_modules": ["model.q_proj"]}, "model.lora.target_modules"),
        ({"rank": 8, "sync": "delta"}, "model.lora.sync"),
    ],
)
def test_bad_lora_values_name_the_key(lora: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build(model={"path": "tiny:0", "lora": lora})


def test_critic_lora_is_checked_under_its_own_key() -> None:
    with pytest.raises(ConfigError, match="critic.lora.rank"):
        build(critic={"lora": {"rank": -2}})


def test_adapter_sync_needs_an_engine_that_serves_adapters() -> None:
    lora = {"rank": 16, "sync": "adapter"}
    with pytest.raises(ConfigError, match="model.lora.sync: adapter needs rollout.engine=vllm"):
        build(model={"path": "tiny:0", "lora": lora}, rollout={"n": 4, "engine": "hf"})
    with pytest.raises(ConfigError, match="model.lora.rank: 1024: with sync=adapter"):
        build(model={"path": "tiny:0", "lora": {**lora, "rank": 1024}})
    with pytest.raises(ConfigError, match="rollout.sleep_level: must be 1"):
        build(model={"path": "tiny:0", "lora": lora}, rollout={"n": 4, "sleep_level": 2})
    # Merged sync streams full tensors: any engine, any rank, any sleep level.
    build(model={"path": "tiny:0", "lora": {"rank": 12}}, rollout={"n": 4, "engine": "hf"})


@pytest.mark.parametrize(
    "override,key,message",
    [
        ("model.lora.rank=-1", "model.lora.rank", "must be >= 0"),
        (
            "model.lora.target_modules=[q_proj,qkv]",
            "model.lora.target_modules",
            "no linear layer named ['qkv']",
        ),
        ("rollout.engine=hf", "model.lora.sync", "cannot serve adapters"),
    ],
)
def test_lora_errors_exit_2_before_ray(override: str, key: str, message: str) -> None:
    args = ["+recipe=grpo_tiny", "model.lora.rank=16", override]
    if override.startswith("rollout.engine"):
        args.append("model.lora.sync=adapter")
    check_config_error(*args, key=key, text=message)


def test_an_moe_model_takes_adapters_on_its_attention_only() -> None:
    """tiny-moe:0's experts are fused parameters and its router a bare one: no linear layer,
    and not what an MoE model's adapters may go on; tiny:0's MLP linears may."""
    moe = read_model_linears(resolve_model_path("tiny-moe:0"), False)
    assert moe.experts and moe.attention == moe.names == ["k_proj", "o_proj", "q_proj", "v_proj"]
    dense = read_model_linears(resolve_model_path("tiny:0"), False)
    assert not dense.experts and {"down_proj", "gate_proj"} <= set(dense.names)


def test_moe_lora_refusals_exit_2_before_ray() -> None:
    check_config_error(
        "+recipe=grpo_tiny_lora",
        "model.path=tiny-moe:0",
        "model.lora.target_modules=[q_proj,gate_up_proj]",
        key="model.lora.target_modules",
        text="['gate_up_proj']: on a mixture-of-experts model adapters go on the attention only",
    )
    lora = {"rank": 8, "sync": "adapter"}
    cfg = build(model={"path": "tiny-moe:0", "lora": lora}, trainer={"device": "cpu"})
    with pytest.raises(ConfigError, match="model.lora.sync: adapter on a mixture-of-experts"):
        check_lora_targets(cfg, resolve_model_path("tiny-moe:0"), trains_on_cpu=True)
    check_lora_targets(cfg, resolve_model_path("tiny-moe:0"), trains_on_cpu=False)  # GPU
    check_lora_targets(cfg, resolve_model_path("tiny:0"), trains_on_cpu=True)  # dense


def test_a_vision_language_model_takes_adapters_on_its_language_model_only() -> None:
    """tiny-vl:0 (Qwen2-VL) with adapters synced as adapters passes the checks before Ray;
    its vision tower's layers are not targets, and naming one is refused."""
    path = resolve_tiny_vl_path("tiny-vl:0")
    linears = read_model_linears(path, False)
    assert {"qkv", "fc1"} <= set(linears.tower) and "q_proj" in linears.names
    assert not set(linears.names) & {"qkv", "proj", "fc1", "fc2"}
    lora = {"rank": 8, "sync": "adapter"}
    cfg = build(model={"path": "tiny-vl:0", "lora": lora}, trainer={"device": "cpu"})
    check_vision(cfg, path, read_model_config(path, False))
    check_lora_targets(cfg, path, trains_on_cpu=True)
    cfg.model.lora.target_modules = ["q_proj", "fc1"]
    with pytest.raises(ConfigError, match=r"target_modules: \['fc1'\] are layers of the vision"):
        check_lora_targets(cfg, path, trains_on_cpu=True)


def test_a_name_the_vision_tower_shares_adapts_the_language_model_alone() -> None:
    """Qwen2.5-VL's vision blocks have ``gate_proj`` too: peft, which matches a name's last
    segment, is handed the language model's layers by their full names."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

    text = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    text |= {"num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64}
    text |= {"rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
    vision |= {"out_hidden_size": 64, "fullatt_block_indexes": [0]}
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(
            Qwen2_5_VLConfig(text_config=text, vision_config=vision)
        )
    assert "gate_proj" in read_decoder_linears(model).tower
    for names, adapted in [([], 14), (["gate_proj"], 2)]:
        lora = LoraConfig(rank=4, target_modules=names)
        targets = list_peft_targets(model, lora)
        assert targets is not None and len(targets) == adapted
        assert all(t.startswith("model.language_model.layers.") for t in targets)
    peft_model = get_peft_model(model, lora.to_peft(targets=targets))
    layers = [n for n, p in peft_model.named_parameters() if "lora_A" in n]
    assert len(layers) == 2 and not any(".visual." in n for n in layers)


def test_a_run_trains_on_cpu_by_its_device_or_a_local_machine_without_gpus() -> None:
    assert not will_train_on_cuda(build(trainer={"device": "cpu"}), local_gpus=8)
    assert not will_train_on_cuda(build(trainer={"device": "auto"}), local_gpus=0)
    assert will_train_on_cuda(build(trainer={"device": "auto"}), local_gpus=1)
    assert will_train_on_cuda(build(trainer={"device": "auto"}, ray={"address": "auto"}), 0)
    assert will_train_on_cuda(build(trainer={"device": "cuda"}), local_gpus=0)
