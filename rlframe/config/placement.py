"""Checks of the rollout placement: which pool holds the rollout engines, that tensor
parallelism fits that pool, that keys of the other placement are not set, and (before a
local Ray starts) that the pools fit this machine.

``colocated``: one pool, ``trainer.nnodes x trainer.procs_per_node`` bundles; each rank holds
training and rollout. ``separate``: that pool trains; a second one,
``rollout.nnodes x rollout.procs_per_node`` bundles, holds only rollout engines.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from rlframe.config.checks import ConfigError, require
from rlframe.config.rollout import Placement, RolloutConfig
from rlframe.config.sections import ActorConfig, TrainerConfig

SEPARATE_ONLY = ("nnodes", "procs_per_node", "cpus_per_proc", "worker_cls")
"""rollout.* keys that size or fill the separate rollout pool."""
COLOCATED_ONLY = ("sleep_level",)
"""rollout.* keys that only matter when the engine shares its process with training (it
sleeps while the rank trains); a separate engine never sleeps."""
TRAIN_WORKER_CLS = "workers.train_worker.TrainWorker"
"""The trainer pool's worker in separate placement when actor.worker_cls is left alone."""


@dataclass(frozen=True)
class PoolShape:
    """One pool's size, and the config section that sets it (named in errors)."""

    section: str
    nnodes: int
    procs_per_node: int
    cpus_per_proc: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.procs_per_node

    @property
    def cpus(self) -> int:
        return self.world_size * self.cpus_per_proc

    def describe(self) -> str:
        return (
            f"{self.nnodes} node(s) x {self.procs_per_node} proc(s) x {self.cpus_per_proc} CPU(s)"
        )


def trainer_pool(t: TrainerConfig) -> PoolShape:
    return PoolShape("trainer", t.nnodes, t.procs_per_node, t.cpus_per_proc)


def rollout_pool(r: RolloutConfig, t: TrainerConfig) -> PoolShape:
    """The pool that holds the rollout engines: the trainer's when colocated."""
    if r.placement is Placement.colocated:
        return trainer_pool(t)
    return PoolShape("rollout", r.nnodes, r.procs_per_node, r.cpus_per_proc)


def list_pools(r: RolloutConfig, t: TrainerConfig) -> list[PoolShape]:
    if r.placement is Placement.colocated:
        return [trainer_pool(t)]
    return [trainer_pool(t), rollout_pool(r, t)]


def resolve_actor_worker_cls(r: RolloutConfig, actor: ActorConfig) -> str:
    """The trainer pool's worker class: actor.worker_cls, except that separate placement
    swaps the default hybrid worker for the training-only one (no engine to build)."""
    default = next(f.default for f in fields(ActorConfig) if f.name == "worker_cls")
    if r.placement is Placement.separate and actor.worker_cls == default:
        return TRAIN_WORKER_CLS
    return actor.worker_cls


def check_placement(r: RolloutConfig, t: TrainerConfig) -> None:
    """Keys of the other placement are unset; TP divides the engines' pool per node."""
    defaults = {f.name: f.default for f in fields(RolloutConfig)}
    other, used_with = (
        (SEPARATE_ONLY, Placement.separate)
        if r.placement is Placement.colocated
        else (COLOCATED_ONLY, Placement.colocated)
    )
    for key in other:
        value = getattr(r, key)
        require(
            value == defaults[key],
            f"rollout.{key}",
            f"is only used with rollout.placement={used_with.value} (got {value!r} with "
            f"rollout.placement={r.placement.value}); remove it or change rollout.placement",
        )
    pool, tp = rollout_pool(r, t), r.tensor_parallel_size
    require(
        pool.procs_per_node % tp == 0,
        "rollout.tensor_parallel_size",
        f"{tp} must divide {pool.section}.procs_per_node = {pool.procs_per_node}: the ranks of "
        "one vLLM engine share a node",
    )


def check_pools_fit(
    r: RolloutConfig, t: TrainerConfig, cpus: int, source: str, extra: tuple[PoolShape, ...] = ()
) -> None:
    """Before a local (one-node) Ray starts: every pool (``extra``: the served models' own
    pools) is one node and together they fit ``cpus`` (what that Ray will advertise, told by
    ``source``)."""
    pools = list_pools(r, t) + list(extra)
    for pool in pools:
        require(
            pool.nnodes == 1,
            f"{pool.section}.nnodes",
            f"is {pool.nnodes}, but the Ray this run starts is this one machine; set it to 1 "
            "or join a cluster (ray.address)",
        )
    need = sum(p.cpus for p in pools)
    names = " + ".join(f"{p.section} pool {p.describe()}" for p in pools)
    require(
        need <= cpus,
        f"{pools[-1].section}.cpus_per_proc",
        f"{names} = {need} CPUs, but the Ray this run starts has {cpus} ({source}); lower "
        f"{' / '.join(f'{p.section}.cpus_per_proc' for p in pools)} or the procs_per_node",
    )


def check_pools_gpus(
    r: RolloutConfig, t: TrainerConfig, gpus: int, source: str, extra: tuple[PoolShape, ...] = ()
) -> None:
    """Before a local (one-node) Ray starts on a GPU machine: every bundle is one whole GPU,
    and the pools together fit ``gpus``.

    A separate rollout pool cannot share the trainer's GPUs: its engines and the trainer
    ranks join one NCCL weight group, and NCCL refuses two ranks on one device. Colocated
    placement shares each GPU between training and rollout in one process.
    """
    pools = list_pools(r, t) + list(extra)
    need = sum(p.world_size for p in pools)
    if need <= gpus:
        return
    if r.placement is Placement.separate and trainer_pool(t).world_size <= gpus:
        raise ConfigError(
            "rollout.placement",
            f"separate puts the rollout engines on GPUs of their own (NCCL cannot hold two "
            f"ranks of the weight group on one GPU): trainer pool "
            f"{trainer_pool(t).world_size} + rollout pool {rollout_pool(r, t).world_size} = "
            f"{need} GPUs, but the Ray this run starts has {gpus} ({source}); use "
            "rollout.placement=colocated, which shares each GPU, or lower rollout.procs_per_node",
        )
    raise ConfigError(
        "trainer.procs_per_node",
        f"is {t.procs_per_node}: one GPU per process, but the Ray this run starts has {gpus} "
        f"({source}); lower it or join a cluster (ray.address)",
    )
