"""Gathering a sharded parameter whole (a collective on every rank of its mesh)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole parameter. FSDP2 root parameters can be plain tensors after a no_grad forward."""
    return value.full_tensor() if isinstance(value, DTensor) else value
