"""The images of training rows, encoded for a vision-language model's forward.

Rows carry their images as encoded bytes (``TrainBatch.images``, a list per row); the trainer
runs the model's own image processor on them, as vLLM does on the same bytes when it samples,
so both sides see the same pixels and the same image-token counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlframe.core.mrope import ImageTokens
from rlframe.core.sequence_layout import RowImages
from rlframe.core.train_batch import TrainBatch
from rlframe.models.images import VisionProcessor, encode_images, load_processor

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


def read_image_tokens(config: PreTrainedConfig) -> ImageTokens | None:
    """How a vision-language model lays out images (None for a text model)."""
    vision = getattr(config, "vision_config", None)
    if vision is None or getattr(config, "image_token_id", None) is None:
        return None
    return ImageTokens(int(config.image_token_id), int(vision.spatial_merge_size))


class ImageEncoder:
    """Turns rows' ``images`` into the :class:`RowImages` of their layout.

    A step's rows repeat their prompt's images (``rollout.n`` samples each) and every pass
    over the batch (old log-probs, reference, update) reads them again, so each distinct
    image is processed once and kept (up to ``CACHED_IMAGES`` of them)."""

    CACHED_IMAGES = 4096

    def __init__(self, model_path: str, tokens: ImageTokens) -> None:
        self.processor: VisionProcessor = load_processor(model_path)
        self.tokens = tokens
        self.cache: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        """Encoded image -> (its patches [p, D], its grid [3])."""

    def encode(self, rows: TrainBatch) -> RowImages:
        """The rows' images in row order; rows of a batch without images have none (they
        still get mrope positions, which a packed layout of this model needs)."""
        per_row = rows.images if rows.images is not None else [[]] * len(rows)
        flat = [image for row in per_row for image in row]
        self.process([image for image in dict.fromkeys(flat) if image not in self.cache])
        counts = [len(r) for r in per_row]
        if not flat:
            empty = torch.empty(0, 0), torch.empty(0, 3, dtype=torch.long)
            return RowImages(*empty, counts, self.tokens)
        pixels = torch.cat([self.cache[image][0] for image in flat])
        grids = torch.stack([self.cache[image][1] for image in flat])
        return RowImages(pixels, grids, counts, self.tokens)

    def process(self, images: list[bytes]) -> None:
        """Run the image processor on ``images`` (in one call) and cache each one's share."""
        if not images:
            return
        if len(self.cache) + len(images) > self.CACHED_IMAGES:
            self.cache.clear()
        inputs = encode_images(self.processor, [images])
        assert inputs is not None
        patches = inputs.pixel_values.split(inputs.image_grid_thw.prod(-1).tolist())
        for image, part, grid in zip(images, patches, inputs.image_grid_thw, strict=True):
            self.cache[image] = (part, grid)


def build_image_encoder(model_path: str, config: PreTrainedConfig) -> ImageEncoder | None:
    """The encoder of a vision-language model's rows; None for a text model."""
    tokens = read_image_tokens(config)
    return None if tokens is None else ImageEncoder(model_path, tokens)
