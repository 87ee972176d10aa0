"""Reading DCP checkpoints in tests: a checkpoint's full state, and bit-for-bit comparison."""

from __future__ import annotations

from pathlib import Path

import torch


def load_shards(checkpoint: Path, scratch: Path) -> dict:
    """The full (unsharded) actor state of a checkpoint: model, optimizer, schedule."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = scratch / (str(checkpoint).replace("/", "_") + ".pt")
    dcp_to_torch_save(checkpoint / "actor", target)
    return torch.load(target, weights_only=False)


def assert_identical(a: object, b: object, where: str) -> None:
    """Nested dicts/lists of tensors and plain values, equal bit for bit."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    else:
        assert a == b, where
