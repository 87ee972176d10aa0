"""A tiny judge: ``tiny:<seed>``'s architecture trained offline to grade the quickstart's
answers, so a judged run (``+recipe=judge_tiny``) has a signal its policy can learn.

``reward.judge.path: tiny-judge:<seed>`` builds (once, then caches) a Qwen2 that reads
``JUDGE_TEMPLATE`` filled with an arithmetic prompt, its reference answer and a response
(``3+4=7:7?``: a reference-guided judge) and answers
one token: ``y`` with the probability that ``char_match`` gives the response, ``n`` with the
rest. Its expected value over ``{y: 1, n: 0}`` is then close to the rule reward, and its
greedy verdict is ``y`` for a response the rule scores above one half. It is trained on
generated verdicts (no data set), on the CPU (one thread), in about a minute.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rlframe.data.tiny_model import (
    CHARACTERS,
    TINY_JUDGE_PREFIX,
    TinyModelSpec,
    build_tiny_config,
    build_tiny_tokenizer,
    resolve_tiny_build,
    save_model_atomically,
)

JUDGE_TEMPLATE = "{prompt}{ground_truth}:{response}?"
"""What the tiny judge reads; ``judge_tiny`` sets ``reward.judge.template`` to it."""
VERDICTS = {"y": 1.0, "n": 0.0}
"""Its verdict tokens and their values."""
TRAIN_STEPS = 1000
BATCH = 64
LR = 1e-3
"""Peak learning rate, decayed linearly to 0. Measured on 1000 held-out verdicts: the
judge's P(y | y or n) is off char_match by 0.065 on average (0.18 at 3e-3). Without the
reference answer in its input it must add, and 1000 steps leave it 0.14 off, rating
``3+4=8`` as ``3+4=7``."""
MAX_RESPONSE = 3
"""Longest response it is trained on (the quickstart's ``rollout.max_tokens``)."""


def resolve_tiny_judge_path(path: str, cache_dir: Path | None = None, build: bool = True) -> str:
    """The cached folder of ``tiny-judge:<seed>``, trained on first use."""
    return resolve_tiny_build(
        path,
        TINY_JUDGE_PREFIX,
        "tiny-qwen2-judge",
        [CHARACTERS, JUDGE_TEMPLATE, VERDICTS, TRAIN_STEPS, BATCH, LR, MAX_RESPONSE],
        build_tiny_judge_model if build else None,
        cache_dir,
    )


def sample_verdict(rng: random.Random) -> tuple[str, float]:
    """One training example: the judge's input and the probability of ``y`` it should give.

    Responses are what a policy of the quickstart says on its way from random to right: any
    characters, mostly digits and newlines, often the right answer first."""
    from rlframe.rewards.rules import score_char_match

    a, b = rng.randint(0, 4), rng.randint(0, 4)
    truth = str(a + b)
    length = rng.randint(0, MAX_RESPONSE)
    chars = []
    for _ in range(length):
        pick = rng.random()
        if pick < 0.5:
            chars.append(rng.choice("0123456789"))
        elif pick < 0.7:
            chars.append("\n")
        else:
            chars.append(rng.choice(CHARACTERS))
    if chars and rng.random() < 0.4:
        chars[0] = truth
    response = "".join(chars)
    text = JUDGE_TEMPLATE.format(prompt=f"{a}+{b}=", response=response, ground_truth=truth)
    return text, score_char_match(response, truth, {})


def build_tiny_judge_model(spec: TinyModelSpec, target: Path) -> None:
    """Train ``tiny:<seed>``'s architecture on generated verdicts (soft targets over ``y``
    and ``n`` at the verdict position; the input's own tokens are not trained) and save it."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = build_tiny_config(spec, tokenizer, tie_word_embeddings=True)
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    yes, no = (int(tokenizer.convert_tokens_to_ids(t)) for t in VERDICTS)  # type: ignore[arg-type]
    rng = random.Random(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / TRAIN_STEPS)
    pad = tokenizer.pad_token_id
    model.train()
    threads = torch.get_num_threads()
    # One thread: on a shared CPU, the small matmuls of this model run several times faster
    # without waiting for a second thread.
    torch.set_num_threads(1)
    try:
        train_on_verdicts(model, tokenizer, rng, (optimizer, schedule), (yes, no, pad))
    finally:
        torch.set_num_threads(threads)
    model.eval()
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    save_model_atomically(model, tokenizer, target)


def train_on_verdicts(
    model: Any,
    tokenizer: Any,
    rng: random.Random,
    optimizer: tuple[Any, Any],
    ids_of: tuple[int, int, int],
) -> None:
    """TRAIN_STEPS steps of BATCH generated verdicts (``optimizer``: it and its schedule)."""
    import torch

    (adam, schedule), (yes, no, pad) = optimizer, ids_of
    for _ in range(TRAIN_STEPS):
        examples = [sample_verdict(rng) for _ in range(BATCH)]
        encoded = [tokenizer.encode(text) for text, _ in examples]
        width = max(len(ids) for ids in encoded)
        # Right-padded: the verdict is read at each row's last real position.
        ids = torch.full((BATCH, width), pad, dtype=torch.long)
        mask = torch.zeros(BATCH, width, dtype=torch.long)
        for i, row in enumerate(encoded):
            ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
        last = mask.sum(1) - 1
        logits = model(input_ids=ids, attention_mask=mask).logits[torch.arange(BATCH), last]
        logp = torch.log_softmax(logits.float(), -1)
        target_yes = torch.tensor([p for _, p in examples])
        loss = -(target_yes * logp[:, yes] + (1 - target_yes) * logp[:, no]).mean()
        adam.zero_grad()
        loss.backward()
        adam.step()
        schedule.step()
