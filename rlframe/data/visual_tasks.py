"""Synthetic visual tasks, generated from a seed: a small image and a question about it whose
answer a rule checks. Offline stand-ins for geometry and chart sets, for the tiny VLM.

``colour``: a filled square of one of COLOURS on a grey background, anywhere in an image of
56 to 112 pixels a side (4 to 16 image tokens of ``tiny-vl:<seed>``); the answer is the
colour's initial (``r``, ``g``, ``b`` or ``y``: one token, like the arithmetic task's digit).
A policy that ignores the image is right a quarter of the time at best.
"""

from __future__ import annotations

import random

from rlframe.models.images import encode_png

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 180, 30),
    "blue": (30, 30, 220),
    "yellow": (230, 210, 20),
}
BACKGROUND = (128, 128, 128)
SIDES = (56, 84, 112)
"""Image widths and heights: multiples of 28, so the processor keeps them as they are."""
COLOUR_PROMPT = "colour?"


def draw_square(rng: random.Random, colour: tuple[int, int, int]) -> bytes:
    """PNG bytes of a grey image with a ``colour`` square covering at least a quarter of it."""
    from PIL import Image, ImageDraw

    width, height = rng.choice(SIDES), rng.choice(SIDES)
    image = Image.new("RGB", (width, height), BACKGROUND)
    side = rng.randint(min(width, height) // 2, min(width, height))
    left, top = rng.randint(0, width - side), rng.randint(0, height - side)
    ImageDraw.Draw(image).rectangle([left, top, left + side - 1, top + side - 1], fill=colour)
    return encode_png(image)


def make_colour(rng: random.Random) -> tuple[str, str, list[bytes]]:
    """(prompt, answer, images) of one ``colour`` example."""
    name = rng.choice(sorted(COLOURS))
    return COLOUR_PROMPT, name[0], [draw_square(rng, COLOURS[name])]
