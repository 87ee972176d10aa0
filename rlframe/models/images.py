"""Images in prompt rows: how a row names them, where the chat template places them, and the
model processor that turns them into vision tokens and pixel values.

A row's ``images`` column (veRL's format) lists its images in order; each is a file path, the
encoded bytes (PNG, JPEG, ...), or a dict with ``bytes`` and/or ``path`` (what a parquet file
of images holds). A turn's text marks where each goes with ``<image>``; turns without any
marker get the images in front of the first user turn. Rows travel with the encoded bytes
(small, picklable); the workers decode them where pixels are needed.
"""

from __future__ import annotations

import functools
import io
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from rlframe.core.tokenizer import Tokenizer

IMAGE_MARKER = "<image>"
"""Where a turn's text places the row's next image (veRL's convention)."""


def read_image_bytes(item: Any, where: str) -> bytes:
    """The encoded bytes of one ``images`` entry: a path, bytes, or ``{"bytes", "path"}``."""
    if isinstance(item, dict):
        item = item.get("bytes") or item.get("path")
    if isinstance(item, bytes | bytearray):
        return bytes(item)
    if isinstance(item, str | Path):
        path = Path(item).expanduser()
        if not path.is_file():
            raise ValueError(f"{where}: image {str(item)!r}: no such file")
        return path.read_bytes()
    raise ValueError(
        f"{where}: an image must be a path, bytes or {{'bytes', 'path'}}, got {type(item).__name__}"
    )


def decode_image(data: bytes) -> Any:
    """The image (PIL, RGB) of encoded bytes."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


def encode_png(image: Any) -> bytes:
    """PNG bytes of a PIL image."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def place_images(
    messages: list[dict[str, Any]], count: int, where: str, payloads: list[bytes] | None = None
) -> list[dict[str, Any]]:
    """The turns with content parts (``{"type": "image"}``, ``{"type": "text", ...}``) that put
    the row's ``count`` images where the ``<image>`` markers are, or before the first user
    turn's text when there are none. The marker count must match the images. With
    ``payloads`` (the ``count`` images' bytes, in order) each image part carries its own as
    ``image``."""
    markers = sum(
        m["content"].count(IMAGE_MARKER) for m in messages if isinstance(m["content"], str)
    )
    if markers not in (0, count):
        raise ValueError(f"{where}: {markers} '{IMAGE_MARKER}' markers for {count} images")
    images = iter(payloads or [])

    def image_part() -> dict[str, Any]:
        return {"type": "image"} if payloads is None else {"type": "image", "image": next(images)}

    placed = []
    front = markers == 0
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            placed.append(message)
            continue
        parts: list[dict[str, Any]] = []
        if front and message["role"] == "user":
            parts += [image_part() for _ in range(count)]
            front = False
        for i, text in enumerate(content.split(IMAGE_MARKER)):
            if i:
                parts.append(image_part())
            if text:
                parts.append({"type": "text", "text": text})
        placed.append({**message, "content": parts})
    if front:
        raise ValueError(f"{where}: images but no user turn to put them in")
    return placed


def is_image(part: Any) -> bool:
    """Whether a message content part is an image (``{"type": "image", ...}``)."""
    return isinstance(part, dict) and part.get("type") == "image"


def read_part_image(part: dict[str, Any], where: str) -> bytes:
    """The encoded bytes of an image part's ``image``: a PIL image (PNG-encoded here), bytes,
    a path or ``{"bytes", "path"}``."""
    image = part.get("image")
    if image is None:
        raise ValueError(f"{where}: an image part carries no 'image' (a PIL image or bytes)")
    if hasattr(image, "save") and hasattr(image, "size"):  # a PIL image
        return encode_png(image)
    return read_image_bytes(image, where)


def collect_images(messages: list[dict[str, Any]], where: str) -> list[bytes]:
    """The encoded images of ``messages``' image parts, in the order the chat template places
    them (messages in order, parts in order); [] for text-only messages."""
    return [
        read_part_image(part, where)
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if is_image(part)
    ]


@dataclass
class VisionInputs:
    """What the vision tower of a micro-batch's rows takes."""

    pixel_values: torch.Tensor
    """[patches, C * T * P * P] every image's patches, rows and images in order."""
    image_grid_thw: torch.Tensor
    """[images, 3] each image's (time, height, width) patch grid."""


class VisionProcessor(Protocol):
    """What rlframe reads of a vision-language model's processor (Qwen2-VL's and the like)."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def image_token(self) -> str:
        """The image pad token, which the processor repeats to each image's token count."""
        ...

    @property
    def image_processor(self) -> Callable[..., Mapping[str, torch.Tensor]]:
        """Images -> ``pixel_values`` and ``image_grid_thw`` (``return_tensors="pt"``)."""
        ...

    def _get_num_multimodal_tokens(
        self, *, image_sizes: list[tuple[int, int]]
    ) -> Mapping[str, list[int]]:
        """``num_image_tokens``: the token count of each (height, width)."""
        ...

    def to_dict(self) -> dict[str, Any]: ...

    def save_pretrained(self, save_directory: str | os.PathLike[str], /) -> object: ...


@functools.lru_cache(maxsize=4)
def load_processor(path: str) -> Any:
    """The model's processor (tokenizer + image processor), loaded once per process; a
    text model's is its tokenizer (a :class:`VisionProcessor` only for a vision-language
    model)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def read_image_size(data: bytes, where: str = "an image") -> tuple[int, int]:
    """(height, width) of encoded image bytes, from the header, after PIL's integrity check
    of the file (``verify``: no pixels decoded). Bytes that are no image PIL reads, or a
    corrupted one, raise ValueError naming ``where``."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            size = image.height, image.width
            image.verify()
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        reason = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", reason)
        raise ValueError(
            f"{where} cannot be decoded ({len(data)} bytes): {type(e).__name__}: {reason}"
        ) from None
    return size


def expand_prompt(
    processor: VisionProcessor, text: str, images: list[bytes], where: str = "the row"
) -> list[int]:
    """The prompt's token ids with each image pad repeated to its image's token count, as
    the processor (and so vLLM, which runs the same one) expands it. The counts come from the
    image sizes alone: no pixels are processed on the driver. ``where`` names the row in
    errors (an image that does not decode: :func:`read_image_size`)."""
    if not hasattr(processor, "image_processor"):
        raise ValueError(f"{where}: has images, the model no image processor (not a VLM)")
    tokenizer = processor.tokenizer
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pad = tokenizer.convert_tokens_to_ids(processor.image_token)
    sizes = [read_image_size(b, f"{where}: image {i}") for i, b in enumerate(images)]
    counts = processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    if ids.count(pad) != len(counts):
        raise ValueError(
            f"{where}: the prompt places {ids.count(pad)} images, the row has {len(counts)}"
        )
    expanded: list[int] = []
    it = iter(counts)
    for token in ids:
        expanded += [token] * (next(it) if token == pad else 1)
    return expanded


def encode_images(
    processor: VisionProcessor, rows_images: list[list[bytes]]
) -> VisionInputs | None:
    """The vision inputs of rows' images in row order; None when no row has one."""
    images = [decode_image(b) for row in rows_images for b in row]
    if not images:
        return None
    out = processor.image_processor(images=images, return_tensors="pt")
    return VisionInputs(out["pixel_values"], out["image_grid_thw"])


PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
"""A model folder with one of these has a processor (a vision-language model's)."""


def save_processor(model_path: str, dest: Path, trust_remote_code: bool = False) -> None:
    """A vision-language model's processor (image processor, chat template) beside the config:
    the export loads and generates with images only with it."""
    if has_processor(model_path, trust_remote_code):
        load_processor(model_path).save_pretrained(dest)


def has_processor(model_path: str, trust_remote_code: bool = False) -> bool:
    """Whether the model has an image processor: a folder by its files; a hub id (no local
    folder: ``Qwen/Qwen2.5-VL-7B-Instruct``) by a vision tower in its config."""
    local = Path(model_path).expanduser()
    if local.is_dir():
        return any((local / name).is_file() for name in PROCESSOR_FILES)
    from rlframe.models.hf_config import has_vision_tower, read_model_config

    return has_vision_tower(read_model_config(model_path, trust_remote_code))


def find_processor_change(saved: Path, model_path: str) -> str | None:
    """The first setting in which the processor saved in ``saved`` (a checkpoint's
    ``hf_config``) and ``model_path``'s differ, as ``key: before, now``; None when they agree
    or ``saved`` holds no processor. A resumed run must expand images to the token counts
    (and sample from the pixels) its checkpoint was trained on."""
    if not any((saved / name).is_file() for name in PROCESSOR_FILES):
        return None
    before = describe_processor(load_processor(str(saved)))
    now = describe_processor(load_processor(model_path))
    for key in sorted(before.keys() | now.keys()):
        if before.get(key) != now.get(key):
            return (
                f"{key}: {shorten(before.get(key))} in the checkpoint, {shorten(now.get(key))} now"
            )
    return None


def describe_processor(processor: Any) -> dict[str, Any]:
    """A processor's settings as flat ``a.b`` keys, its chat template included."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix.removesuffix(".")] = value

    walk("", processor.to_dict() | {"chat_template": getattr(processor, "chat_template", None)})
    return flat


def shorten(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
