"""A tiny model with a long tail of response lengths, for bench/async_modes.py.

``tiny:0`` fine-tuned (supervised, a minute on CPU) on ``grpo_tiny``'s arithmetic prompts
``a+b=``: most prompts are answered with a few characters and EOS; prompts with
``a + b >= 7`` (3 of the 25, 12%) are answered with characters that never stop, so their
responses run to ``rollout.max_tokens``. The lengths are the prompt's, shared by a group,
which is what makes a step wait for its slowest groups (random lengths inside every group
would make every group as slow as its longest response).

    python bench/long_tail_model.py   # builds (once) and prints the model's folder
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlframe.data.tiny_model import (  # noqa: E402
    CHARACTERS,
    build_tiny_tokenizer,
    default_cache_dir,
    resolve_model_path,
    save_model_atomically,
)

LONG_RESPONSE = 136
FILLER = "abcdefghijklmnopqrstuvwxyz"


def is_long(a: int, b: int) -> bool:
    return a + b >= 7


def make_example(rng: random.Random) -> tuple[str, str, bool]:
    a, b = rng.randint(0, 4), rng.randint(0, 4)
    if is_long(a, b):
        return f"{a}+{b}=", "".join(rng.choice(FILLER) for _ in range(LONG_RESPONSE)), False
    filler = "".join(rng.choice(FILLER) for _ in range(rng.randint(0, 4)))
    return f"{a}+{b}=", str(a + b) + filler, True


def build_long_tail_model(target: Path, steps: int = 200, seed: int = 0) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny:0"))
    model.train()
    torch.set_num_threads(2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    for _ in range(steps):
        rows, labels = [], []
        for _ in range(16):
            prompt, response, stops = make_example(rng)
            p = tokenizer(prompt)["input_ids"]
            r = tokenizer(response)["input_ids"] + ([tokenizer.eos_token_id] if stops else [])
            rows.append(p + r)
            labels.append([-100] * len(p) + r)
        width = max(len(x) for x in rows)
        ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x in rows])
        lab = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
        mask = (lab != -100) | (torch.arange(width) < torch.tensor([[len(x)] for x in rows]))
        loss = model(input_ids=ids, attention_mask=mask.long(), labels=lab).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    save_model_atomically(model, tokenizer, target)


def resolve_long_tail_model() -> str:
    """The model's folder, built on first use (cached beside the tiny models)."""
    target = default_cache_dir() / f"long-tail-qwen2-{len(CHARACTERS)}"
    if not (target / "config.json").exists():
        build_long_tail_model(target)
    return str(target)


if __name__ == "__main__":
    print(resolve_long_tail_model())
