"""``tiny-vl:<seed>``: a random-initialised 2-layer Qwen2-VL with its processor, built offline.

Like ``tiny:<seed>`` (:mod:`rlframe.data.tiny_model`) it is built once from a seed and cached;
the folder loads in transformers (``AutoModelForImageTextToText``, ``AutoProcessor``) and in
vLLM like any Qwen2-VL checkpoint. The tokenizer is the tiny character-level one plus
Qwen2-VL's vision tokens (each one token); the image processor resizes every image to between
``MIN_PIXELS`` and ``MAX_PIXELS``, so an image costs 4 to 16 tokens of the sequence.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

from rlframe.data.tiny_model import (
    CHARACTERS,
    TINY_MOE_FAMILY_PREFIX,
    TINY_TEACHER_PREFIX,
    TINY_VL_PREFIX,
    TinyModelSpec,
    build_tiny_tokenizer,
    resolve_model_path,
    resolve_tiny_build,
    save_model_atomically,
)
from rlframe.data.tiny_moe_families import resolve_tiny_moe_family
from rlframe.data.tiny_teacher import resolve_tiny_teacher

if TYPE_CHECKING:
    from transformers import (
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
        Qwen2VLConfig,
        Qwen2VLProcessor,
    )

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
"""Qwen2-VL's vision tokens, appended after the tiny vocabulary (ids 52-55)."""
PATCH_SIZE = 14
"""Pixels per side of a vision patch (Qwen2-VL's)."""
MERGE_SIZE = 2
"""Patches per side merged into one language-model token."""
MIN_PIXELS = 56 * 56
"""Smallest image area after resizing: 4x4 patches, 4 image tokens."""
MAX_PIXELS = 112 * 112
"""Largest image area after resizing: 8x8 patches, 16 image tokens."""
VISION_DEPTH = 2
"""Vision transformer blocks."""
VISION_WIDTH = 64
"""Width of the vision transformer."""
MROPE_SECTION = (8, 12, 12)
"""Rotary frequencies per axis (time, height, width); they sum to head_dim / 2 (64 / 2)."""
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}"
    + VISION_START
    + IMAGE_PAD
    + VISION_END
    + "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}{%- endfor -%}"
)
"""Turns' texts in order; an image part becomes the vision-start, one image pad (the processor
repeats it to the image's token count) and the vision-end token. No role markers: the tiny
tasks are plain continuations, as for ``tiny:<seed>``; a model turn ends with the EOS token
(the stop token), so multi-turn episodes can place an observation after it."""


def build_tiny_vl_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny character-level tokenizer with the vision tokens and the chat template."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_vl_processor(tokenizer: PreTrainedTokenizerBase) -> Qwen2VLProcessor:
    """Qwen2-VL's processor over ``tokenizer``, with small images (MIN_PIXELS..MAX_PIXELS)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    sizes = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}
    common = {"patch_size": PATCH_SIZE, "merge_size": MERGE_SIZE, "temporal_patch_size": 2}
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**sizes, **common),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**sizes, **common),
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_vl_config(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerBase) -> Qwen2VLConfig:
    """The Qwen2-VL config: ``spec``'s language model, a 2-block vision tower."""
    from transformers import Qwen2VLConfig

    # A list of tokens in, a list of ids out (the annotation covers one token too).
    vision_ids = cast(list[int], tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)))
    ids = dict(zip(VISION_TOKENS, vision_ids))
    special = {
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_positions,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": list(MROPE_SECTION),
        },
        "tie_word_embeddings": True,
        **special,
    }
    vision = {
        "depth": VISION_DEPTH,
        "embed_dim": VISION_WIDTH,
        "hidden_size": spec.hidden_size,
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": 2,
    }
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
        dtype="float32",
        **special,
    )


def build_tiny_vl_model(spec: TinyModelSpec, target: Path) -> None:
    """Write a random-initialised tiny Qwen2-VL, its tokenizer and processor to ``target``."""
    import torch
    from transformers import GenerationConfig, Qwen2VLForConditionalGeneration

    tokenizer = build_tiny_vl_tokenizer()
    torch.manual_seed(spec.seed)
    model = Qwen2VLForConditionalGeneration(build_tiny_vl_config(spec, tokenizer))
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    save_model_atomically(model, build_tiny_vl_processor(tokenizer), target)


TINY_VL_KEY = [CHARACTERS, list(VISION_TOKENS), CHAT_TEMPLATE, MIN_PIXELS, MAX_PIXELS]
"""What the cached folder's name hashes besides the spec."""


def resolve_tiny_vl_path(path: str, cache_dir: Path | None = None, build: bool = True) -> str:
    """The cached folder of ``tiny-vl:<seed>`` (built on first use; ``build=False``: the
    folder, built or not); ``tiny-moe-<model_type>:<seed>`` as
    :func:`rlframe.data.tiny_moe_families.resolve_tiny_moe_family`; any other path as
    :func:`rlframe.data.tiny_model.resolve_model_path` resolves it. The driver resolves every
    ``model.path`` here."""
    if path.startswith(TINY_MOE_FAMILY_PREFIX):
        return resolve_tiny_moe_family(path, cache_dir, build)
    if path.startswith(TINY_TEACHER_PREFIX):
        return resolve_tiny_teacher(path, cache_dir, build)
    if not path.startswith(TINY_VL_PREFIX):
        return resolve_model_path(path, cache_dir, build)
    return resolve_tiny_build(
        path,
        TINY_VL_PREFIX,
        "tiny-qwen2-vl",
        TINY_VL_KEY,
        build_tiny_vl_model if build else None,
        cache_dir,
    )
