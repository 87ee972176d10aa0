"""A tiny random-initialised reward model, built like the tiny policy (see ``tiny_model.py``).

``reward.model.path: tiny-rm:<seed>`` builds (once, then caches) a Qwen2
``ForSequenceClassification`` with one label and the tiny character tokenizer, plus a chat
template of its own (``user: ...\\nassistant: ...\\n``), so the reward-model worker's path
through its own tokenizer and template runs in tests without a download. Its scores are
random but fixed by the seed.
"""

from __future__ import annotations

from pathlib import Path

from rlframe.data.tiny_model import (
    CHARACTERS,
    TinyModelSpec,
    build_tiny_config,
    build_tiny_tokenizer,
    resolve_tiny_build,
    save_model_atomically,
)

TINY_RM_PREFIX = "tiny-rm:"
# Only characters of the tiny vocabulary, so the rendered chat has no unknown tokens.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def is_tiny_reward_model(path: str) -> bool:
    return path.startswith(TINY_RM_PREFIX)


def resolve_reward_model_path(path: str, cache_dir: Path | None = None) -> str:
    """A loadable reward-model directory: ``tiny-rm:<seed>`` is built on first use."""
    if not is_tiny_reward_model(path):
        return path
    return resolve_tiny_build(
        path,
        TINY_RM_PREFIX,
        "tiny-qwen2-rm",
        [CHARACTERS, CHAT_TEMPLATE],
        build_tiny_reward_model,
        cache_dir,
    )


def build_tiny_reward_model(spec: TinyModelSpec, target: Path) -> None:
    """Write a random-initialised one-label Qwen2 sequence classifier and its tokenizer.

    Written to a temporary folder first and renamed, so concurrent builders never see a
    half-written model.
    """
    import torch
    from transformers import Qwen2ForSequenceClassification

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    config = build_tiny_config(spec, tokenizer, num_labels=1)
    torch.manual_seed(spec.seed)
    model = Qwen2ForSequenceClassification(config)
    # The default init leaves the score head near zero; scale it so rewards differ visibly.
    torch.nn.init.normal_(model.score.weight, std=1.0)
    save_model_atomically(model, tokenizer, target)
