"""Sharded save and load of a training engine with ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards of the model and optimizer state into one folder, plus the
LR schedule's position; DCP's metadata describes the whole tensors, so a checkpoint loads on
another world size too (DCP reshards on load). The folder's ``model.*`` entries use the HF
parameter names, which is what :mod:`rlframe.state.export` reads to write a Hugging Face model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from workers.training.expert_parallel import ExpertParallel
    from workers.training.fsdp import FSDPEngine


def pick_state_options(engine: FSDPEngine, strict: bool = False) -> StateDictOptions:
    """Under LoRA the frozen base is left out: a checkpoint holds what trains (the adapters,
    a critic's value head) and its optimizer state; the base is the model folder's."""
    frozen = any(not p.requires_grad for p in engine.model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=strict and not frozen)


def require_optimizer(engine: FSDPEngine) -> Optimizer:
    """The engine's optimizer: only an engine that trains has state to save or load."""
    if engine.optimizer is None:
        raise ValueError("only an engine that trains has state to save or load")
    return engine.optimizer


def collect_engine_state(engine: FSDPEngine) -> dict[str, Any]:
    """Model and optimizer state as DCP wants it (sharded DTensors, FQN keys)."""
    optimizer = require_optimizer(engine)
    options = pick_state_options(engine)
    model_state, optim_state = get_state_dict(engine.model, optimizer, options=options)
    if options.ignore_frozen_params:
        # A weight tied to a frozen one (lm_head to the embeddings) is still a state entry.
        trains = {n for n, p in engine.model.named_parameters() if p.requires_grad}
        model_state = {k: v for k, v in model_state.items() if k in trains}
    if engine.ep is not None:
        wrap_expert_state(engine.ep, engine.ep.param_names(engine.model), model_state, optim_state)
    return {"model": model_state, "optim": optim_state, "scheduler": engine.scheduler.state_dict()}


def wrap_expert_state(
    plan: ExpertParallel, names: set[str], model_state: dict[str, Any], optim_state: dict[str, Any]
) -> None:
    """Expert-parallel experts and their optimizer state as slices of the whole tensors
    (:meth:`ExpertParallel.as_global`): every rank holds other experts under the same name,
    which DCP would otherwise take for copies of one tensor and save once.

    A parameter's moments dict from ``get_state_dict`` is the optimizer's own: the wrappers
    go into a new dict, or the next AdamW step after a save would meet DTensor moments."""
    for name in names & model_state.keys():
        model_state[name] = plan.as_global(model_state[name])
    for name in names & optim_state["state"].keys():
        optim_state["state"][name] = {
            # The step count is one scalar, the same on every rank.
            key: plan.as_global(value) if value.ndim > 0 else value
            for key, value in optim_state["state"][name].items()
        }


def unwrap_expert_state(names: set[str], state: dict[str, Any]) -> None:
    """The local slices back (the wrappers share their storage, which DCP loaded into)."""
    model_state, optim_state = state["model"], state["optim"]["state"]
    for name in names & model_state.keys():
        model_state[name] = model_state[name].to_local()
    for name in names & optim_state.keys():
        moments = optim_state[name]
        for key, value in moments.items():
            if isinstance(value, DTensor):
                moments[key] = value.to_local()


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
    if engine.ep is not None:
        unwrap_expert_state(engine.ep.param_names(engine.model), state)
    set_state_dict(
        engine.model,
        require_optimizer(engine),
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=pick_state_options(engine, strict=True),
    )
    engine.scheduler.load_state_dict(state["scheduler"])
    loaded: dict[str, Any] = state["extra"]
    return loaded
