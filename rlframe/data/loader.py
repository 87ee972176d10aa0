"""The prompt loader: shuffled batches of prompts, turned into the Batch a step starts from."""

from __future__ import annotations

import random
from typing import Any

import torch

from rlframe.core.protocol import Batch
from rlframe.data.prompts import PromptRecord


class PromptLoader:
    """Endless shuffled batches over the records; each pass over the data reshuffles.

    It keeps its own ``random.Random``: vLLM reseeds the global generators in the workers,
    and the driver's data order must not depend on anything else.
    """

    def __init__(self, records: list[PromptRecord], batch_size: int, seed: int) -> None:
        if len(records) < batch_size:
            raise ValueError(
                f"data.batch_size={batch_size} exceeds the {len(records)} prompts available"
            )
        self.records, self.batch_size = records, batch_size
        self.rng = random.Random(seed)
        self.order: list[int] = []

    def next_records(self) -> list[PromptRecord]:
        if len(self.order) < self.batch_size:
            order = list(range(len(self.records)))
            self.rng.shuffle(order)
            self.order = order
        picked, self.order = self.order[: self.batch_size], self.order[self.batch_size :]
        return [self.records[i] for i in picked]

    def state_dict(self) -> dict[str, Any]:
        """The rest of the current pass and the shuffling generator (JSON-serialisable)."""
        version, internal, gauss = self.rng.getstate()
        return {
            "order": list(self.order),
            "rng": [version, list(internal), gauss],
            "num_records": len(self.records),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_records"] != len(self.records):
            raise ValueError(
                f"the checkpoint's prompt loader ran over {state['num_records']} prompts, "
                f"this run has {len(self.records)}: resume with the same data files and "
                "data.max_prompt_length"
            )
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.order = list(state["order"])


def build_prompt_batch(
    records: list[PromptRecord], n: int, first_group: int, pad_token_id: int, seed: int
) -> Batch:
    """``n`` interleaved copies of each prompt, left-padded, with group ids and sample seeds;
    an ``images`` column (each row's encoded images) when any prompt has images.

    Row ``i`` gets seed ``(seed, group, copy)`` mixed into 31 bits, so sampling does not
    depend on how rows are split over ranks.
    """
    width = max(len(r.prompt_ids) for r in records)
    ids = torch.full((len(records), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(records), width, dtype=torch.long)
    for i, r in enumerate(records):
        ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids) :] = 1
    groups = torch.arange(first_group, first_group + len(records))
    columns: dict[str, list[Any]] = {
        "prompt": [r.prompt for r in records],
        "ground_truth": [r.ground_truth for r in records],
        "extra": [r.extra for r in records],
        # Synthetic prompts have no turns of their own: the prompt text is one user turn.
        "messages": [r.messages or [{"role": "user", "content": r.prompt}] for r in records],
    }
    if any(r.images for r in records):
        columns["images"] = [list(r.images) for r in records]
    batch = Batch({"prompt_ids": ids, "prompt_mask": mask, "group": groups}, columns).repeat(n)
    copies = torch.arange(len(batch)) % n
    seeds = [
        hash((seed, int(g), int(c))) & 0x7FFFFFFF for g, c in zip(batch.tensor("group"), copies)
    ]
    return Batch(batch.tensors, batch.columns | {"seed": seeds}, batch.meta)
