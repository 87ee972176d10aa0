"""What the Ray-tier tests of the real workers build: prompts for the tiny model, and the
log-prob gap between the rollout engine and the trainer."""

from __future__ import annotations

import torch

from rlframe.data.loader import build_prompt_batch
from rlframe.data.prompts import load_prompt_records
from rlframe.data.tiny_model import build_tiny_tokenizer
from rlframe.protocol import Batch


def prompts_for(step: int) -> Batch:
    """4 arithmetic prompts x 4 samples, seeded by ``step``, with the stop and pad ids the
    engines need."""
    tok = build_tiny_tokenizer()
    records = load_prompt_records([], "arithmetic", tok, 16, seed=step, synthetic_size=4)
    batch = build_prompt_batch(
        records, n=4, first_group=0, pad_token_id=tok.pad_token_id, seed=step
    )
    batch.meta |= {"stop_token_ids": [tok.eos_token_id], "pad_token_id": tok.pad_token_id}
    return batch


def logprob_gap(batch: Batch, trainer_logprobs: torch.Tensor) -> float:
    """The largest |rollout - trainer| log-prob over the batch's response tokens."""
    mask = batch["response_mask"]
    return float(((batch["rollout_logprobs"] - trainer_logprobs).abs() * mask).max())
