"""A tiny teacher for on-policy distillation, built offline: ``tiny-teacher:<seed>``.

``tiny:<seed>``'s architecture and tokenizer (so a ``tiny:N`` student shares its token ids),
fine-tuned with plain supervised steps on the answers of the synthetic tasks it is named
for, then cached like the other tiny models. It answers the quickstart's addition with high
probability and still spreads some mass, the shape of a strong teacher's distribution;
``distill_tiny`` distils it into a fresh ``tiny:0``. Built in a few seconds on 2 cores.
"""

from __future__ import annotations

import random
from pathlib import Path

from rlframe.data.tiny_model import (
    CHARACTERS,
    TINY_TEACHER_PREFIX,
    TinyModelSpec,
    resolve_tiny_build,
)

TEACHER_TASKS = ("arithmetic",)
"""The synthetic tasks the teacher learns (every prompt of each, with its answer)."""
TEACHER_STEPS = 150
TEACHER_LR = 3e-3
TEACHER_BATCH = 64


def build_tiny_teacher(spec: TinyModelSpec, target: Path) -> None:
    """``tiny:<seed>``, trained on (prompt, answer + EOS) pairs of :data:`TEACHER_TASKS`
    (the loss on the answer tokens alone), saved to ``target``."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    from rlframe.data.tasks import TASKS
    from rlframe.data.tiny_model import (
        build_tiny_config,
        build_tiny_tokenizer,
        save_model_atomically,
    )

    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(build_tiny_config(spec, tokenizer, tie_word_embeddings=True))
    rng = random.Random(spec.seed)
    pairs = sorted({TASKS[t](rng) for t in TEACHER_TASKS for _ in range(2000)})
    rows = [(tokenizer.encode(p), tokenizer.encode(a) + [tokenizer.eos_token_id]) for p, a in pairs]
    optimizer = torch.optim.AdamW(model.parameters(), lr=TEACHER_LR)
    generator = torch.Generator().manual_seed(spec.seed)
    model.train()
    for _ in range(TEACHER_STEPS):
        picks = torch.randint(len(rows), (TEACHER_BATCH,), generator=generator).tolist()
        ids, labels = pad_pairs([rows[i] for i in picks], tokenizer.pad_token_id)
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    save_model_atomically(model, tokenizer, target)


def pad_pairs(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[object, object]:
    """Right-padded ``input_ids`` and ``labels`` (-100 on the prompt and the padding)."""
    import torch

    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (prompt, answer) in enumerate(rows):
        ids[i, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[i, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
    return ids, labels


TEACHER_KEY = [CHARACTERS, TEACHER_TASKS, TEACHER_STEPS, TEACHER_LR, TEACHER_BATCH]
"""What the cached folder's name hashes beside the spec: a change builds a new teacher."""


def resolve_tiny_teacher(path: str, cache_dir: Path | None = None, build: bool = True) -> str:
    """The cached folder of ``tiny-teacher:<seed>`` (built on first use; ``build=False``:
    the folder, built or not)."""
    return resolve_tiny_build(
        path,
        TINY_TEACHER_PREFIX,
        "tiny-qwen2-teacher",
        TEACHER_KEY,
        build_tiny_teacher if build else None,
        cache_dir,
    )
