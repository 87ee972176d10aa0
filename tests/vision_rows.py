"""Rows with images for the vision-language tests: the ``colour`` task's prompts, expanded by
the tiny VLM's processor, with random responses, one of them a multi-turn episode whose
observation shows an image (a helper module, not a test)."""

from __future__ import annotations

import random
from typing import Any

import torch

from rlframe.core.protocol import Batch
from rlframe.data.visual_tasks import make_colour
from rlframe.models.images import expand_prompt, load_processor


def make_vision_batch(
    model_path: str, rows: int, response: int = 5, seed: int = 0, observation_row: int = 1
) -> Batch:
    """``rows`` rows of left-padded image prompts (images of several sizes, so their token
    counts differ) and right-padded random responses of 1..``response`` tokens, the first of
    which opens with the image token; every third row has no image. Row ``observation_row``
    (one with an image) is a multi-turn episode: a sampled turn, an observation (loss mask 0)
    showing a second image, and another sampled turn; its ``images`` are then both, in order."""
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
            ids = expand_prompt(processor, render_user_turn(processor, prompt), pictures)
        prompts.append(ids)
        images.append(pictures)
    width = max(len(p) for p in prompts)
    prompt_ids = torch.zeros(rows, width, dtype=torch.long)
    prompt_mask = torch.zeros(rows, width, dtype=torch.long)
    for i, ids in enumerate(prompts):
        prompt_ids[i, width - len(ids) :] = torch.tensor(ids)
        prompt_mask[i, width - len(ids) :] = 1
    lengths = torch.randint(1, response + 1, (rows,), generator=g)
    responses = [torch.randint(3, 40, (int(n),), generator=g).tolist() for n in lengths]
    sampled = [[1] * len(r) for r in responses]
    # A sampled image token is text: no image stands behind it.
    responses[0][0] = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    if observation_row < rows:
        assert images[observation_row], "the observation row needs a prompt image"
        _, _, shown = make_colour(rng)
        seen = expand_prompt(processor, render_user_turn(processor, "again?"), shown)
        after = torch.randint(3, 40, (3,), generator=g).tolist()
        responses[observation_row] += seen + after
        sampled[observation_row] += [0] * len(seen) + [1] * len(after)
        images[observation_row] = images[observation_row] + shown
    longest = max(len(r) for r in responses)
    response_ids = torch.zeros(rows, longest, dtype=torch.long)
    response_mask, loss_mask = torch.zeros(rows, longest), torch.zeros(rows, longest)
    for i, (ids, mask) in enumerate(zip(responses, sampled)):
        response_ids[i, : len(ids)] = torch.tensor(ids)
        response_mask[i, : len(ids)] = 1
        loss_mask[i, : len(ids)] = torch.tensor(mask, dtype=torch.float32)
    return Batch(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": response_ids,
            "response_mask": response_mask,
            "loss_mask": loss_mask,
        },
        {"images": images},
    )


def render_user_turn(processor: Any, text: str) -> str:
    """A user turn of one image and ``text``, through the processor's chat template."""
    parts = [{"type": "image"}, {"type": "text", "text": text}]
    return processor.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
