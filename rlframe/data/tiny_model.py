"""A tiny random-initialised Qwen2-architecture model with a character-level tokenizer.

Nothing can be downloaded on CI or offline machines, so the quickstart and the tests build
their model here, from a seed, with ``save_pretrained``: the result loads in transformers
and in vLLM like any checkpoint. ``model.path: tiny:<seed>`` in a recipe builds (once, then
caches) and uses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import (
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
        ProcessorMixin,
        Qwen2Config,
    )

TINY_PREFIX = "tiny:"
TINY_LORA_PREFIX = "tiny-lora:"
TINY_MOE_PREFIX = "tiny-moe:"
TINY_TEACHER_PREFIX = "tiny-teacher:"
"""A tiny teacher for distillation (:mod:`rlframe.data.tiny_teacher`)."""
TINY_JUDGE_PREFIX = "tiny-judge:"
"""A tiny judge of the quickstart's answers (:mod:`rlframe.judges.tiny_judge`)."""
TINY_MOE_FAMILY_PREFIX = "tiny-moe-"
"""``tiny-moe-<model_type>:<seed>``: another MoE family (:mod:`rlframe.data.tiny_moe_families`)."""
MOE_EXPERTS = 8
"""Routed experts per layer of ``tiny-moe:<seed>``."""
MOE_TOP_K = 2
"""Experts each token is routed to in ``tiny-moe:<seed>``."""
LORA_HEAD_SCALE = 2.0
"""The final norm's scale of ``tiny-lora:<seed>`` (see :func:`build_tiny_lora_model`)."""
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
# Everything the synthetic tasks print, one token per character.
CHARACTERS = "0123456789abcdefghijklmnopqrstuvwxyz +-*=?:,.()'\n"


@dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 2
    """Attention heads; head_dim = hidden_size / num_heads must be >= 32 for vLLM's CPU kernels."""
    num_kv_heads: int = 1
    """Key/value heads (grouped-query attention as in Qwen2)."""
    intermediate_size: int = 256
    """MLP width."""
    max_positions: int = 512
    """Longest prompt + response."""
    seed: int = 0
    """Seed of the random initialisation."""


TINY_VL_PREFIX = "tiny-vl:"
"""A tiny Qwen2-VL (:mod:`rlframe.data.tiny_vl_model`)."""


def is_tiny_model(path: str) -> bool:
    return path.startswith(
        (
            TINY_PREFIX,
            TINY_LORA_PREFIX,
            TINY_MOE_PREFIX,
            TINY_MOE_FAMILY_PREFIX,
            TINY_VL_PREFIX,
            TINY_TEACHER_PREFIX,
            TINY_JUDGE_PREFIX,
        )
    )


def default_cache_dir() -> Path:
    return Path(os.environ.get("RLFRAME_CACHE", Path.home() / ".cache" / "rlframe"))


def resolve_model_path(path: str, cache_dir: Path | None = None, build: bool = True) -> str:
    """A loadable model directory: ``tiny:<seed>``, ``tiny-lora:<seed>`` and
    ``tiny-moe:<seed>`` are built on first use (``build=False``: their cached folder, built or
    not), anything else is kept (``tiny-vl:<seed>``:
    :func:`rlframe.data.tiny_vl_model.resolve_tiny_vl_path`, which also resolves
    ``tiny-moe-<model_type>:<seed>``; :func:`rlframe.run.preflight.resolve_model_folder`
    trains ``tiny-judge:<seed>``)."""
    if path.startswith(TINY_MOE_PREFIX):
        return resolve_tiny_build(
            path,
            TINY_MOE_PREFIX,
            "tiny-qwen3-moe",
            [CHARACTERS, MOE_EXPERTS, MOE_TOP_K],
            build_tiny_moe_model if build else None,
            cache_dir,
        )
    if path.startswith(TINY_LORA_PREFIX):
        return resolve_tiny_build(
            path,
            TINY_LORA_PREFIX,
            "tiny-qwen2-lora",
            [CHARACTERS, LORA_HEAD_SCALE],
            build_tiny_lora_model if build else None,
            cache_dir,
        )
    if not is_tiny_model(path):
        return path
    return resolve_tiny_build(
        path,
        TINY_PREFIX,
        "tiny-qwen2",
        [CHARACTERS],
        build_tiny_model if build else None,
        cache_dir,
    )


def resolve_tiny_build(
    path: str,
    prefix: str,
    folder: str,
    key_parts: list[Any],
    build: Callable[[TinyModelSpec, Path], None] | None,
    cache_dir: Path | None,
) -> str:
    """The cached folder of the tiny model ``<prefix><seed>``, built by ``build`` on first use
    (None: the folder, built or not).

    The folder name hashes the spec and ``key_parts`` (vocabulary, templates), so a change to
    either builds a new model instead of reusing a stale one."""
    seed_text = path[len(prefix) :] or "0"
    if not seed_text.isdigit():
        raise ValueError(f"{path!r}: use '{prefix}<integer seed>', e.g. '{prefix}0'")
    spec = TinyModelSpec(seed=int(seed_text))
    key = hashlib.sha1(json.dumps([asdict(spec), *key_parts]).encode()).hexdigest()[:12]
    target = (cache_dir or default_cache_dir()) / f"{folder}-{key}"
    if build is not None and not (target / "config.json").exists():
        build(spec, target)
    return str(target)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: every character in CHARACTERS is one token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *CHARACTERS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def build_tiny_config(
    spec: TinyModelSpec, tokenizer: PreTrainedTokenizerBase, **extra: Any
) -> Qwen2Config:
    """The Qwen2 config of a tiny model of ``spec`` over ``tokenizer``; ``extra`` adds the
    head-specific keys (tied embeddings, number of labels)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **extra,
    )


def build_tiny_model(spec: TinyModelSpec, target: Path) -> None:
    """Write a random-initialised Qwen2 model and its tokenizer to ``target``.

    Written to a temporary folder first and renamed, so concurrent builders (several
    workers, several tests) never see a half-written model.
    """
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = build_tiny_config(spec, tokenizer, tie_word_embeddings=True)
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    save_model_atomically(model, tokenizer, target)


def build_tiny_lora_model(spec: TinyModelSpec, target: Path) -> None:
    """``tiny:<seed>`` with its final norm scaled by LORA_HEAD_SCALE: a base for LoRA.

    LoRA trains neither the tied embedding/LM head nor the norms. At the random init (std
    0.02) the head's rows are so short that no hidden state gives any token more than about
    0.18 probability, so a policy that only trains adapters cannot become confident, whatever
    it learns; full fine-tuning grows the head. A pretrained model's head has no such cap,
    and this scale removes it here (a token can then reach probability near 1)."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = build_tiny_config(spec, tokenizer, tie_word_embeddings=True)
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.mul_(LORA_HEAD_SCALE)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    save_model_atomically(model, tokenizer, target)


def build_tiny_moe_model(spec: TinyModelSpec, target: Path) -> None:
    """Write a random-initialised Qwen3-MoE model (MOE_EXPERTS experts per layer, top
    MOE_TOP_K, every layer sparse) over the tiny tokenizer to ``target``.

    Each expert is half the dense model's MLP width, so a token's active MLP parameters equal
    ``tiny:<seed>``'s: the two compare at the same active size (bench/moe_throughput.py)."""
    import torch
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.intermediate_size // MOE_TOP_K,
        num_experts=MOE_EXPERTS,
        num_experts_per_tok=MOE_TOP_K,
        norm_topk_prob=True,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen3MoeForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    save_model_atomically(model, tokenizer, target)


def save_model_atomically(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | ProcessorMixin, target: Path
) -> None:
    """Write model and tokenizer (or processor) to a staging folder, then rename it to
    ``target``: several processes (test workers, Ray actors) may build the same cached model
    at once."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f"{target.name}.tmp{os.getpid()}")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)
    except OSError:
        if not (target / "config.json").exists():
            raise
        # Another process finished first; its copy is identical.
        shutil.rmtree(staging, ignore_errors=True)
