"""Sharded save and load of a training engine with ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards of the model and optimizer state into one folder, plus the
LR schedule's position; DCP's metadata describes the whole tensors, so a checkpoint loads on
another world size too (DCP reshards on load). The folder's ``model.*`` entries use the HF
parameter names, which is what :mod:`rlframe.export` reads to write a Hugging Face model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

if TYPE_CHECKING:
    from workers.engines.fsdp import FSDPEngine


def collect_engine_state(engine: FSDPEngine) -> dict[str, Any]:
    """Model and optimizer state as DCP wants it (sharded DTensors, FQN keys)."""
    assert engine.optimizer is not None, "only an engine that trains has state to save"
    model_state, optim_state = get_state_dict(engine.model, engine.optimizer)
    return {"model": model_state, "optim": optim_state, "scheduler": engine.scheduler.state_dict()}


def save_engine(engine: FSDPEngine, path: str | Path, extra: dict[str, Any] | None = None) -> None:
    """Write this rank's shards (a collective: every rank of the group must call it)."""
    state = collect_engine_state(engine) | {"extra": extra or {}}
    dcp.save(state, checkpoint_id=str(path))


def load_engine(
    engine: FSDPEngine, path: str | Path, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Load model, optimizer and schedule in place; returns ``extra`` with the saved values.

    DCP loads into the objects it is given, so the state starts as the engine's own (right
    shapes and shardings) and is then handed back through ``set_state_dict``; ``extra`` names
    the other entries wanted (with defaults).
    """
    state = collect_engine_state(engine) | {"extra": dict(extra or {})}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        engine.model,
        engine.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(strict=True),
    )
    engine.scheduler.load_state_dict(state["scheduler"])
    return state["extra"]
