"""The experience producer's checkpoint state as JSON, with the binary values rows carry.

Token rows and scored groups hold more than JSON has: a prompt's images (encoded bytes, a
row's and a record's ``images``), a row's routed experts (one tensor), a batch's tensors.
:func:`encode_state` puts each such value once in a blob table (base64 of its bytes, keyed by
their SHA-256) and leaves a tag in its place; :func:`decode_state` puts them back. Exact: a
tensor's blob is its raw memory, so it comes back bit for bit in its dtype and shape (NaN
payloads and -0.0 included), and a row's images are the bytes the engine was sent. The n rows
of a group share their prompt's images, so the table holds each image once, however many rows
and records name it.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import torch

from rlframe.core.protocol import SAMPLE_MASK, Batch

TAG = "$rlframe"
"""The key of a dict that stands for a binary value (no state dict of rlframe's has it)."""
BLOBS = "blobs"
"""The key of the encoded state's blob table."""


def encode_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as JSON-able values: its keys as they are, bytes and tensors anywhere in it
    replaced by tags, and the blob table they refer to under :data:`BLOBS`.

    Raises:
        TypeError: naming where a value is neither JSON nor bytes nor a tensor.
    """
    if BLOBS in state:
        raise ValueError(f"a state to encode must not have a {BLOBS!r} key")
    blobs: dict[str, str] = {}
    encoded = {k: encode_value(v, blobs, k) for k, v in state.items()}
    return encoded | {BLOBS: blobs}


def decode_state(saved: dict[str, Any]) -> dict[str, Any]:
    """The state :func:`encode_state` encoded (a state without blob table is returned as it
    is: one saved before images and tensors went in blobs)."""
    blobs = saved.get(BLOBS, {})
    return {k: decode_value(v, blobs) for k, v in saved.items() if k != BLOBS}


def encode_value(value: Any, blobs: dict[str, str], where: str) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): encode_value(v, blobs, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode_value(v, blobs, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, bytes | bytearray):
        return {TAG: "bytes", "blob": add_blob(bytes(value), blobs)}
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {
            TAG: "tensor",
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "blob": add_blob(raw, blobs),
        }
    raise TypeError(f"{where}: a {type(value).__name__} cannot be saved in the producer state")


def decode_value(value: Any, blobs: dict[str, str]) -> Any:
    if isinstance(value, list):
        return [decode_value(v, blobs) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(TAG)
    if kind is None:
        return {k: decode_value(v, blobs) for k, v in value.items()}
    raw = base64.b64decode(blobs[value["blob"]])
    if kind == "bytes":
        return raw
    dtype = getattr(torch, value["dtype"])
    # A copy: frombuffer shares the (read-only) bytes, and the rows' tensors must own theirs.
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0)
    return flat.to(torch.uint8).view(dtype).reshape(value["shape"]).clone()


def add_blob(raw: bytes, blobs: dict[str, str]) -> str:
    """The key of ``raw`` in the table, adding it on first sight."""
    key = hashlib.sha256(raw).hexdigest()
    blobs.setdefault(key, base64.b64encode(raw).decode("ascii"))
    return key


def add_missing_columns(scored: Batch) -> Batch:
    """A scored group saved before samples could be masked or rewards retried gets the
    columns the reward stage adds now (every sample counts, none retried), so it joins
    groups scored after the resume."""
    missing = {SAMPLE_MASK: torch.ones(len(scored))}
    if "reward_errors" in scored:
        missing["reward_retries"] = torch.zeros(len(scored))
    return scored.with_tensors(**{k: v for k, v in missing.items() if k not in scored})
