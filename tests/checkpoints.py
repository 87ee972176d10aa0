"""Checkpoints in tests: a checkpoint's full state, bit-for-bit comparison, and a copy of a
run directory set to resume from one of its checkpoints."""

from __future__ import annotations

import shutil
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


def resume_from_copy(straight: Path, out: Path, step: int) -> Path:
    """A copy of ``straight``'s run directory set to resume from its checkpoint at ``step``."""
    shutil.copytree(straight, out, symlinks=True, ignore=shutil.ignore_patterns(".lock"))
    ckpts = out / "checkpoints"
    for later in ckpts.glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    (ckpts / "latest").write_text(f"step_{step:08d}")
    return ckpts / f"step_{step:08d}"
