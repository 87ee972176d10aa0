"""Every rank's FSDP2 shards from rank 0's full weights: rank 0 alone reads the checkpoint.

The other ranks build the model on the meta device, so loading a 7B model on 8 ranks holds
one fp32 copy in host memory instead of eight. The shards are filled by a broadcast of each
full tensor from rank 0 (``set_model_state_dict`` with ``broadcast_from_rank0``); buffers
outside the state dict (rotary ``inv_freq``) are broadcast too, as the meta ranks have none.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch.distributed as dist
from torch import nn

M = TypeVar("M", bound=nn.Module)


def load_rank0_state(model: M, full_state: dict[str, Any], device: str) -> M:
    """``model``, sharded (FSDP2) on every rank and still on the meta device on every rank
    but 0, with rank 0's ``full_state`` (its unsharded ``state_dict``; empty elsewhere) in
    every rank's shards and rank 0's buffers in every rank's buffers. A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if dist.get_rank() == 0:
        model = model.to(device)
    else:
        model = model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state, options=options)
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    return model
