"""Rows with images for the vision-language tests: the ``colour`` task's prompts, expanded by
the tiny VLM's processor, with random responses (a helper module, not a test)."""

from __future__ import annotations

import random

import torch

from rlframe.data.images import expand_prompt, load_processor
from rlframe.data.visual_tasks import make_colour
from rlframe.protocol import Batch


def make_vision_batch(model_path: str, rows: int, response: int = 5, seed: int = 0) -> Batch:
    """``rows`` rows of left-padded image prompts (images of several sizes, so their token
    counts differ) and right-padded random responses of 1..``response`` tokens, the first of
    which opens with the image token; every third row has no image."""
    processor = load_processor(model_path)
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    prompts, images = [], []
    for i in range(rows):
        prompt, _, pictures = make_colour(rng)
        if i % 3 == 2:
            ids = processor.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            pictures = []
        else:
            parts = [{"type": "image"}, {"type": "text", "text": prompt}]
            text = processor.apply_chat_template(
                [{"role": "user", "content": parts}], tokenize=False
            )
            ids = expand_prompt(processor, text, pictures)
        prompts.append(ids)
        images.append(pictures)
    width = max(len(p) for p in prompts)
    prompt_ids = torch.zeros(rows, width, dtype=torch.long)
    prompt_mask = torch.zeros(rows, width, dtype=torch.long)
    for i, ids in enumerate(prompts):
        prompt_ids[i, width - len(ids) :] = torch.tensor(ids)
        prompt_mask[i, width - len(ids) :] = 1
    lengths = torch.randint(1, response + 1, (rows,), generator=g)
    response_mask = (torch.arange(response)[None] < lengths[:, None]).float()
    response_ids = torch.randint(3, 40, (rows, response), generator=g) * response_mask.long()
    # A sampled image token is text: no image stands behind it.
    response_ids[0, 0] = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    return Batch(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": response_ids,
            "response_mask": response_mask,
            "loss_mask": response_mask.clone(),
        },
        {"images": images},
    )
