"""How a frozen model is served beside the policy: a teacher (``distill``) or a judge
(``reward.judge``). The sections that serve one inherit :class:`ServedModelConfig`, so every
served model has the same keys under its own section.

A served model runs on engine replicas of the request stream (``RolloutWorker`` s built from
its folder, never synced): ``separate`` gives it a pool of its own; ``colocated`` puts one
engine process on each of the trainer's bundles, asleep while the policy trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from rlframe.config.checks import require, require_positive
from rlframe.config.placement import PoolShape
from rlframe.config.rollout import RolloutEngineName
from rlframe.config.sections import TrainerConfig

if TYPE_CHECKING:
    from rlframe.config.schema import Config

MAX_TOP_K = 20
"""The most top-k log-probs one position may return (vLLM's default ``max_logprobs``)."""


class ServedPlacement(str, Enum):
    """Where a served model's engines live."""

    separate = "separate"
    colocated = "colocated"


@dataclass
class ServedModelConfig:
    placement: ServedPlacement = ServedPlacement.separate
    """separate: a pool of its own (``nnodes x procs_per_node`` bundles); colocated: one
    engine process on each trainer bundle, asleep while the policy trains (on GPU it then
    shares each device with training and the policy's engine)."""
    nnodes: int = 1
    """placement=separate: nodes of the served model's pool."""
    procs_per_node: int = 1
    """placement=separate: engine processes per node (one GPU each on GPU nodes)."""
    cpus_per_proc: int = 1
    """CPUs of each of its bundles (placement=separate; OMP threads of its engine on CPU)."""
    tensor_parallel_size: int = 1
    """Ranks that hold one engine (vLLM); replicas = processes / this."""
    engine: RolloutEngineName = RolloutEngineName.vllm
    """vllm, or hf (transformers, one request at a time: for debugging)."""
    gpu_memory_utilization: float = 0.3
    """On cuda: the fraction of a device its engine takes (weights and KV cache)."""
    max_model_len: int = 0
    """Tokens one scored sequence may hold; 0: the run's prompt + response width."""

    def __post_init__(self) -> None:
        if isinstance(self.placement, str):
            self.placement = ServedPlacement(self.placement)
        if isinstance(self.engine, str):
            self.engine = RolloutEngineName(self.engine)


def check_served(served: ServedModelConfig, section: str, trainer: TrainerConfig) -> None:
    """The keys of one served model, named under ``section``."""
    for key in ("nnodes", "procs_per_node", "cpus_per_proc", "tensor_parallel_size"):
        require_positive(getattr(served, key), f"{section}.{key}")
    require(
        served.max_model_len >= 0, f"{section}.max_model_len", "must be >= 0 (0: the run's width)"
    )
    require(
        0 < served.gpu_memory_utilization < 1,
        f"{section}.gpu_memory_utilization",
        f"must be in (0, 1), got {served.gpu_memory_utilization}",
    )
    tp = served.tensor_parallel_size
    require(
        tp == 1 or served.engine is RolloutEngineName.vllm,
        f"{section}.tensor_parallel_size",
        f"{tp} > 1 needs {section}.engine=vllm (the hf engine is not sharded)",
    )
    shape = served_pool(served, section, trainer)
    require(
        shape.procs_per_node % tp == 0,
        f"{section}.tensor_parallel_size",
        f"{tp} must divide {shape.section}.procs_per_node = {shape.procs_per_node}: the ranks "
        "of one engine share a node",
    )
    if served.placement is ServedPlacement.colocated:
        for key in ("nnodes", "procs_per_node", "cpus_per_proc"):
            require(
                getattr(served, key) == 1,
                f"{section}.{key}",
                f"is only used with {section}.placement=separate (colocated: one engine "
                "process on each trainer bundle)",
            )


def served_pool(served: ServedModelConfig, section: str, trainer: TrainerConfig) -> PoolShape:
    """The bundles a served model's engines use: its own pool, or the trainer's."""
    if served.placement is ServedPlacement.colocated:
        return PoolShape("trainer", trainer.nnodes, trainer.procs_per_node, trainer.cpus_per_proc)
    return PoolShape(section, served.nnodes, served.procs_per_node, served.cpus_per_proc)


@dataclass(frozen=True)
class ServedSpec:
    """One frozen model the run serves."""

    name: str
    """Its name in metrics and errors (``teacher``, ``teacher/math``, ``judge``)."""
    path: str
    """Its folder, hub id or tiny-model id, as configured."""
    section: str
    """The config section that asked for it (its serving keys' prefix)."""
    key: str
    """The key that holds ``path`` (named in errors)."""
    serving: ServedModelConfig

    @property
    def pool(self) -> PoolShape | None:
        """Its own pool's shape (placement=separate), or None on the trainer's bundles."""
        s = self.serving
        if s.placement is ServedPlacement.colocated:
            return None
        return PoolShape(self.section, s.nnodes, s.procs_per_node, s.cpus_per_proc)


def list_served_models(cfg: Config) -> list[ServedSpec]:
    """Every frozen model the config serves: the teachers of ``distill``, the judge of
    ``reward.judge``."""
    d = cfg.distill
    specs = [ServedSpec("teacher", d.teacher, "distill", "distill.teacher", d)] if d.teacher else []
    specs += [
        ServedSpec(f"teacher/{k}", path, "distill", f"distill.teachers.{k}", d)
        for k, path in d.teachers.items()
    ]
    judge = cfg.reward.judge
    if judge.path is not None:
        specs.append(ServedSpec("judge", judge.path, "reward.judge", "reward.judge.path", judge))
    return specs
