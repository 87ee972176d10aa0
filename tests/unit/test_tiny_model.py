"""The offline tiny model: builds, caches, and loads back in transformers."""

from __future__ import annotations

from pathlib import Path

import torch

from rlframe.data.tiny_model import CHARACTERS, resolve_model_path


def test_tiny_model_builds_once_and_loads(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path("tiny:0", cache_dir=tmp_path)
    assert resolve_model_path("tiny:0", cache_dir=tmp_path) == path
    assert resolve_model_path("Qwen/Qwen2.5-0.5B", cache_dir=tmp_path) == "Qwen/Qwen2.5-0.5B"

    tok = AutoTokenizer.from_pretrained(path)
    text = "12+7=19"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert len(tok) == len(CHARACTERS) + 3 and tok.eos_token == "<eos>"

    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert model.config.hidden_size // model.config.num_attention_heads >= 32
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(logits).all()

    # The same seed gives the same weights; another seed does not.
    again = AutoModelForCausalLM.from_pretrained(
        resolve_model_path("tiny:0", cache_dir=tmp_path / "b")
    )
    other = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny:1", cache_dir=tmp_path))
    w = model.model.embed_tokens.weight
    assert torch.equal(w, again.model.embed_tokens.weight) and not torch.equal(
        w, other.model.embed_tokens.weight
    )
