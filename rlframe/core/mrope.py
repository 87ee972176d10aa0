"""Qwen2-VL's multi-dimensional rotary positions (mrope) of a token sequence with images.

Every token gets three positions (time, height, width). A text token has the same position
on all three, one more than the token before; an image's tokens lie on its merged patch grid,
offset by the position where the image starts, and the text after it continues from that
start plus the grid's longer side. Generated tokens are text, so a response continues the
count where its prompt left off: the positions vLLM gives them while sampling.

Pure tensor code: the layouts of :mod:`rlframe.core.sequence_layout` call it per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageTokens:
    """How a model lays images out in its sequence."""

    image_token_id: int
    """The token that stands for one merged patch of an image."""
    merge_size: int
    """Patches per side merged into one token."""


def count_image_tokens(grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """[images] tokens each image of ``grid_thw`` ([images, 3]) takes in the sequence."""
    return grid_thw.prod(-1) // merge_size**2


def compute_mrope_positions(
    ids: torch.Tensor, grid_thw: torch.Tensor, layout: ImageTokens
) -> torch.Tensor:
    """[3, L] positions of one row's real tokens ``ids`` ([L]), whose image tokens belong to
    the images of ``grid_thw`` ([images, 3]) in order.

    Raises:
        ValueError: when the row's image tokens do not add up to its images' grids.
    """
    counts = count_image_tokens(grid_thw, layout.merge_size).tolist()
    is_image = ids == layout.image_token_id
    if int(is_image.sum()) != sum(counts):
        raise ValueError(
            f"the row holds {int(is_image.sum())} image tokens, its {len(counts)} images "
            f"need {sum(counts)}"
        )
    positions = torch.empty(3, len(ids), dtype=torch.long)
    at, next_position, image = 0, 0, 0
    flags = is_image.tolist()
    while at < len(ids):
        if not flags[at]:
            positions[:, at] = next_position
            at, next_position = at + 1, next_position + 1
            continue
        t, h, w = (int(v) for v in grid_thw[image])
        h, w = h // layout.merge_size, w // layout.merge_size
        grid = torch.stack(
            torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        ).reshape(3, -1)
        positions[:, at : at + grid.shape[1]] = grid + next_position
        at += grid.shape[1]
        next_position += max(h, w)
        image += 1
    return positions
