"""``tiny-moe-<model_type>:<seed>``: a tiny random mixture-of-experts model of any family that
transformers and vLLM both serve (``tiny-moe-mixtral:0``, ``tiny-moe-deepseek_v3:0``), over
the tiny character tokenizer, built offline from the family's own config class.

Each family's config defaults describe a large model; :data:`TINY_MOE_SHAPE` shrinks every
size field the family has to the tiny spec (2 layers, hidden 128, 4 experts of width 64,
top-2), through the config's constructor, so that derived fields (layer types, the dense
layers of a DeepSeek) follow. ``tiny-moe:<seed>`` (Qwen3-MoE, 8 experts) stays the project's
default MoE model (:mod:`rlframe.data.tiny_model`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlframe.data.tiny_model import (
    CHARACTERS,
    TINY_MOE_FAMILY_PREFIX,
    TinyModelSpec,
    build_tiny_tokenizer,
    resolve_tiny_build,
    save_model_atomically,
)

TINY_FAMILY_EXPERTS = 4
"""Routed experts per layer of a ``tiny-moe-<model_type>`` model."""

TINY_MOE_SHAPE: dict[str, Any] = {
    # Widths: vLLM's CPU attention needs head_dim >= 32.
    "hidden_size": 128,
    "d_model": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "head_dim": 64,
    # Depth and heads.
    "num_hidden_layers": 2,
    "n_layers": 2,
    "num_attention_heads": 2,
    "n_heads": 2,
    "num_key_value_heads": 1,
    # Experts, under each family's name for them.
    "num_experts": TINY_FAMILY_EXPERTS,
    "num_local_experts": TINY_FAMILY_EXPERTS,
    "n_routed_experts": TINY_FAMILY_EXPERTS,
    "moe_num_experts": TINY_FAMILY_EXPERTS,
    "num_experts_per_tok": 2,
    "moe_top_k": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    # Every layer sparse: a dense first layer would leave one MoE layer of two.
    "first_k_dense_replace": 0,
    # DeepSeek's multi-head latent attention, small.
    "kv_lora_rank": 32,
    "q_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "max_position_embeddings": 512,
    "max_seq_len": 512,
}
"""The size fields a family's config may have, at the tiny model's sizes; a family takes
those its config class knows."""

FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    # vLLM reads head_dim from the config, which transformers derives for GLM-4-MoE.
    "glm4_moe": {"head_dim": 64},
    # vLLM's Llama 4 applies the routing weight before the expert, which it runs for top-1 only.
    "llama4_text": {"num_experts_per_tok": 1},
    # vLLM reads the rotary width from the config; transformers derives it.
    "minimax_m2": {"rotary_dim": 32},
    # DBRX nests its attention and MLP sizes.
    "dbrx": {
        "attn_config": {"kv_n_heads": 1, "rope_theta": 10000.0},
        "ffn_config": {
            "ffn_hidden_size": 64,
            "moe_num_experts": TINY_FAMILY_EXPERTS,
            "moe_top_k": 2,
        },
    },
}
"""Fields a family needs beyond :data:`TINY_MOE_SHAPE`."""


def is_tiny_moe_family(path: str) -> bool:
    return path.startswith(TINY_MOE_FAMILY_PREFIX)


def split_family_path(path: str) -> tuple[str, str]:
    """``tiny-moe-mixtral:0`` -> (``mixtral``, ``0``)."""
    family, _, seed = path[len(TINY_MOE_FAMILY_PREFIX) :].partition(":")
    if not family:
        raise ValueError(f"{path!r}: use '{TINY_MOE_FAMILY_PREFIX}<model_type>:<seed>'")
    return family, seed or "0"


def resolve_tiny_moe_family(path: str, cache_dir: Path | None = None, build: bool = True) -> str:
    """The cached folder of ``tiny-moe-<model_type>:<seed>``, built on first use."""
    family, seed = split_family_path(path)

    def build_family(spec: TinyModelSpec, target: Path) -> None:
        build_tiny_moe_family(family, spec.seed, target)

    return resolve_tiny_build(
        f"{family}:{seed}",
        f"{family}:",
        f"tiny-moe-{family}",
        [CHARACTERS, TINY_MOE_SHAPE, FAMILY_FIELDS.get(family)],
        build_family if build else None,
        cache_dir,
    )


def build_tiny_moe_config(model_type: str, vocab_size: int, special: dict[str, int]) -> Any:
    """The family's config at the tiny sizes (fp32), with the tokenizer's special ids."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    sizes = {k: v for k, v in TINY_MOE_SHAPE.items() if hasattr(default, k)}
    sizes |= FAMILY_FIELDS.get(model_type, {})
    return AutoConfig.for_model(
        model_type, vocab_size=vocab_size, dtype="float32", **sizes, **special
    )


def build_tiny_moe_family(model_type: str, seed: int, target: Path) -> None:
    """Write a random-initialised tiny model of ``model_type`` and its tokenizer to
    ``target`` (a staging folder renamed into place)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = build_tiny_tokenizer()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    special = {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": pad}
    config = build_tiny_moe_config(model_type, len(tokenizer), special)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    save_model_atomically(model, tokenizer, target)
