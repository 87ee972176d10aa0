"""Training names and engine names of the weights: the one place that maps the two.

Training ``state_dict`` names carry the segments of module wrappers (torch.compile,
activation checkpointing) and of peft (``base_model.model.`` in front, ``base_layer`` /
``lora_A.default`` inside an adapted layer); the rollout engine's loader expects the names of
the HF checkpoint, and vLLM's LoRA loader those of a saved peft adapter.

Layouts too: transformers 5 holds a mixture-of-experts layer's experts fused
(``mlp.experts.gate_up_proj`` [experts, 2 * inter, hidden], ``mlp.experts.down_proj``
[experts, hidden, inter]), while the checkpoints of those models, HF's own
``save_pretrained`` and vLLM's loader name each expert
(``mlp.experts.{e}.gate_proj.weight`` [inter, hidden]). The sync sends the checkpoint's
per-expert tensors (views, no copies), so the engine receives exactly what it loads from disk
and vLLM's expert-parallel loader can skip the experts another rank holds.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# Module wrappers that insert a path segment into training names but not into checkpoints:
# torch.compile and activation-checkpoint wrappers.
WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module"})


# What peft puts around the HF model (``base_model.model.``) and around an adapted layer's
# original weights (``q_proj.base_layer.weight``).
PEFT_PREFIX = "base_model.model."
PEFT_BASE_SEGMENT = "base_layer"


def to_engine_name(train_name: str) -> str:
    """The name the rollout engine's loader expects (the HF checkpoint name) for a training
    ``state_dict`` name. This is the one place that maps the two."""
    name = train_name.removeprefix(PEFT_PREFIX)
    skip = WRAPPER_SEGMENTS | {PEFT_BASE_SEGMENT}
    return ".".join(part for part in name.split(".") if part not in skip)


# Model types whose checkpoints name each expert and whose transformers modules fuse them as
# [experts, gate | up, hidden] and [experts, hidden, inter]: transformers 5.19's
# conversion_mapping maps these to its "qwen2_moe" pattern (MergeModulelist + Concatenate on
# load, reverted on save). Other fused layouts (transposed as in qwen3_vl_moe, interleaved as
# in gpt_oss) are natively fused on disk too and travel as they are.
PER_EXPERT_MODEL_TYPES = frozenset(
    {
        "qwen2_moe",
        "qwen3_moe",
        "qwen3_next",
        "qwen3_omni_moe",
        "olmoe",
        "flex_olmo",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "dots1",
        "ernie4_5_moe",
        "glm4_moe",
        "glm4_moe_lite",
        "hunyuan_v1_moe",
        "exaone_moe",
    }
)
FUSED_GATE_UP = "gate_up_proj"
FUSED_DOWN = "down_proj"


def to_engine_tensors(
    train_name: str, tensor: torch.Tensor, model_type: str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(engine name, tensor)`` pairs of one training ``state_dict`` entry: itself under
    its engine name, or, for the fused experts of a :data:`PER_EXPERT_MODEL_TYPES` model,
    one view per expert and projection under the checkpoint's names."""
    name = to_engine_name(train_name)
    head, _, leaf = name.rpartition(".experts.")
    if model_type not in PER_EXPERT_MODEL_TYPES or tensor.ndim != 3 or not head:
        yield name, tensor
    elif leaf == FUSED_GATE_UP:
        # transformers computes ``gate, up = (x @ gate_up[e].T).chunk(2, dim=-1)``.
        gate, up = tensor.chunk(2, dim=1)
        for projection, part in (("gate_proj", gate), ("up_proj", up)):
            for expert, weight in enumerate(part.unbind(0)):
                yield f"{head}.experts.{expert}.{projection}.weight", weight
    elif leaf == FUSED_DOWN:
        for expert, weight in enumerate(tensor.unbind(0)):
            yield f"{head}.experts.{expert}.down_proj.weight", weight
    else:
        yield name, tensor


def to_model_tensor(params: dict[str, torch.Tensor], engine_name: str) -> torch.Tensor:
    """The tensor of a transformers model's ``state_dict`` that the engine tensor
    ``engine_name`` fills: its own entry, or, for a per-expert checkpoint name, that expert's
    view of the fused experts (the inverse of :func:`to_engine_tensors`, for an engine that
    holds the transformers model itself)."""
    if engine_name in params:
        return params[engine_name]
    head, _, leaf = engine_name.rpartition(".experts.")
    expert, _, projection = leaf.partition(".")
    if not head or not expert.isdigit():
        raise KeyError(engine_name)
    if projection == "down_proj.weight":
        return params[f"{head}.experts.{FUSED_DOWN}"][int(expert)]
    gate, up = params[f"{head}.experts.{FUSED_GATE_UP}"][int(expert)].chunk(2, dim=0)
    if projection == "gate_proj.weight":
        return gate
    if projection == "up_proj.weight":
        return up
    raise KeyError(engine_name)


def model_type_of(model: torch.nn.Module) -> str | None:
    """The HF ``model_type`` of a (possibly wrapped) transformers model, None without one."""
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None)


def to_adapter_name(train_name: str, adapter: str = "default") -> str:
    """The name of an adapter tensor in a saved peft adapter (and to vLLM's LoRA loader) for
    a training ``state_dict`` name: ``...q_proj.lora_A.default.weight`` ->
    ``...q_proj.lora_A.weight``, wrapper segments dropped, peft's prefix kept."""
    parts = [p for p in train_name.split(".") if p not in WRAPPER_SEGMENTS and p != adapter]
    return ".".join(parts)
