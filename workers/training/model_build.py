"""Building a model that trains or scores under FSDP2: the HF model loaded, then adapters,
gradient checkpointing, the FSDP2 sharding and the shards on the device, in that order (see
:func:`build_train_model`); and the choices made on the way (attention kernel, dtypes,
sequence packing). :class:`workers.training.fsdp.FSDPEngine` is built on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from rlframe.models.hf_config import VISION_TOWER_SEGMENT, has_vision_tower
from workers.training.expert_parallel import ExpertParallel
from workers.training.hf_model import HFModel
from workers.training.rank0_load import load_rank0_state
from workers.training.ulysses import SequenceParallel, register_ulysses_attention

if TYPE_CHECKING:  # the config package needs omegaconf, which bench/gpu_check.py goes without
    from transformers import PreTrainedModel

    from rlframe.config import ModelConfig
    from rlframe.config.lora import LoraConfig


def choose_attention(device: str, dtype: torch.dtype, has_flash_attn: bool) -> str:
    """flash_attention_2 on cuda where flash-attn is installed and the compute dtype is one
    it runs (bf16/fp16; it rejects fp32), else PyTorch's sdpa."""
    half = dtype in (torch.bfloat16, torch.float16)
    return "flash_attention_2" if device == "cuda" and half and has_flash_attn else "sdpa"


def pick_attention(device: str, dtype: torch.dtype) -> str:
    """:func:`choose_attention` for this process (whether flash-attn imports)."""
    if device != "cuda":
        return "sdpa"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "sdpa"
    return choose_attention(device, dtype, has_flash_attn=True)


def resolve_packing(setting: bool | None, device: str, dtype: torch.dtype) -> bool:
    """``actor.pack_sequences``: null packs exactly where flash-attention's varlen kernels run."""
    if setting is not None:
        return setting
    return pick_attention(device, dtype) == "flash_attention_2"


def pick_dtype(setting: str, device: str) -> torch.dtype:
    """A model's ``dtype`` setting: ``auto`` is bf16 on cuda and fp32 on cpu."""
    if setting == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return cast(torch.dtype, getattr(torch, setting))  # the config allows dtype names only


def load_hf_model(
    path: str,
    cfg: ModelConfig,
    device: str,
    head: str,
    attention: str | None = None,
    weights: bool = True,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """The HF model in ``dtype``: fp32 master weights for a model that trains (FSDP casts to
    the compute dtype), the compute dtype for a frozen one.

    ``head="lm"``: the causal LM (a vision-language model's image-text-to-text model).
    ``head="value"``: the same backbone with a freshly
    initialised scalar head per token (a critic), as ``AutoModelForTokenClassification``.
    ``attention``: a registered attention implementation (default :func:`pick_attention`).
    ``weights=False``: the architecture alone on the meta device (no memory, nothing read
    but the config), for ranks that receive rank 0's weights.
    """
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForTokenClassification,
    )

    kwargs = {
        "dtype": dtype,
        "attn_implementation": attention or pick_attention(device, pick_dtype(cfg.dtype, device)),
        "trust_remote_code": cfg.trust_remote_code,
    }
    auto: type[AutoModelForCausalLM | AutoModelForImageTextToText | AutoModelForTokenClassification]
    auto = AutoModelForTokenClassification if head == "value" else AutoModelForCausalLM
    config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    if has_vision_tower(config):
        if head != "lm":
            raise NotImplementedError(f"a {head} head on a vision-language model")
        auto = AutoModelForImageTextToText
    if head == "value":
        config.num_labels = 1
        # No dropout before the value head (HF defaults it to 0.1): values in the update must
        # be those compute_values gave, which the clipped value loss compares them with.
        config.classifier_dropout = 0.0
    if not weights:
        with torch.device("meta"):
            # The auto classes' from_config is unannotated; it builds a PreTrainedModel.
            return cast("PreTrainedModel", auto.from_config(config, **kwargs))
    return auto.from_pretrained(path, config=config, **kwargs)


# The attribute that holds the decoder blocks in HF models (Llama/Qwen: ``layers``, GPT-2: ``h``).
LAYER_LIST_NAMES = ("layers", "h", "blocks")


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks, wherever a head or wrapper put the backbone: ``model.layers`` of a
    causal LM, a sequence or token classifier alike, ``base_model.model.model.layers`` under
    PEFT. The first (outermost) module list with a decoder-block name."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in LAYER_LIST_NAMES:
            return module
    raise ValueError(
        f"{type(model).__name__} has no decoder-layer list named one of {LAYER_LIST_NAMES}"
    )


def find_block_lists(model: nn.Module) -> list[nn.ModuleList]:
    """Every outermost block list: the decoder layers, and a vision-language model's vision
    blocks beside them (Qwen2-VL's ``visual.blocks``)."""
    found: list[tuple[str, nn.ModuleList]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or name.rsplit(".", 1)[-1] not in LAYER_LIST_NAMES:
            continue
        if not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    if not found:
        find_decoder_layers(model)  # raises, naming what it looked for
    return [module for _, module in found]


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    ignored: set[nn.Parameter] | None = None,
) -> None:
    """Shard each decoder layer (and vision block), then the root (embeddings, final norm,
    the head; a vision tower's patch embedding and merger). ``ignored``: parameters FSDP2
    leaves alone (expert-parallel experts, each rank's own).

    Per-layer units keep only one layer's full parameters alive at a time. Gradients are
    reduced in fp32 whatever the compute dtype, so small updates are not lost.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in (layer for blocks in find_block_lists(model) for layer in blocks):
        fully_shard(layer, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)


def freeze_vision_tower(model: nn.Module) -> None:
    """Stop the vision tower's parameters from training (``model.freeze_vision``)."""
    towers = [
        m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == VISION_TOWER_SEGMENT
    ]
    if not towers:
        raise ValueError(f"model.freeze_vision: {type(model).__name__} has no vision tower")
    for tower in towers:
        tower.requires_grad_(False)


def build_train_model(
    path: str,
    cfg: ModelConfig,
    device: str,
    head: str = "lm",
    lora: LoraConfig | None = None,
    sp: SequenceParallel | None = None,
    frozen: bool = False,
    expert_parallel_size: int = 1,
) -> HFModel:
    """Load (with the Ulysses attention wrapper under sequence parallelism), then (1) LoRA
    adapters, (2) gradient checkpointing, (3) FSDP2 sharding, (4) the local shards on the
    device.

    Adapters come first so that checkpointing and sharding see the adapted layers (each
    layer's shard holds its adapters); checkpointing wraps the layers before sharding so
    that FSDP's hooks see the wrapped modules. With several ranks only rank 0 reads the
    checkpoint into host memory; the others build the model on the meta device and receive
    their shards from rank 0 (host memory: one full model, on rank 0, not one per rank).
    Parameters are sharded over all ranks whatever the sequence-parallel size: the sequence
    groups share activations, not weights. With ``expert_parallel_size`` > 1 the routed
    experts are split over the expert groups before sharding and left out of FSDP2
    (:mod:`workers.training.expert_parallel`); every rank then reads the checkpoint itself.
    """
    # Rank 0's broadcast of full tensors cannot fill experts that differ per rank.
    spread = dist.get_world_size() > 1 and expert_parallel_size == 1
    rank0 = dist.get_rank() == 0
    # A frozen model (the reference) needs no fp32 master copy: half the memory in bf16.
    dtype = pick_dtype(cfg.dtype, device) if frozen else torch.float32
    attention = register_ulysses_attention(sp.kernel) if sp is not None else None
    base = load_hf_model(
        path, cfg, device, head, attention, weights=rank0 or not spread, dtype=dtype
    )
    model: HFModel = base
    if cfg.freeze_vision:
        freeze_vision_tower(model)
    if lora is not None and lora.enabled:
        from workers.training.lora import apply_lora

        model = apply_lora(base, lora, head)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Taken before sharding: the full tensors stay referenced here until they are sent.
    full_state = model.state_dict() if spread and rank0 else {}
    experts: list[nn.Parameter] = []
    if expert_parallel_size > 1:
        plan = ExpertParallel(expert_parallel_size, device)
        plan.apply(model)
        setattr(model, "rlframe_expert_parallel", plan)  # noqa: B010 (read back by find_expert_parallel)
        experts = plan.params()
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    apply_fsdp(model, mesh, pick_dtype(cfg.dtype, device), set(experts))
    if not spread:
        return model.to(device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) types `to` unbound
    return load_rank0_state(model, full_state, device)
