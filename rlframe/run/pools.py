"""The run's worker pools and groups for its rollout placement, and the two callables at
the weight seam that the loop is given.

- ``colocated``: one pool (``trainer.*``); hybrid actor workers hold training and rollout,
  and the critic and the reward model share their bundles. ``generate`` is the actor
  group's, ``sync_weights`` the in-process copy on every rank.
- ``separate``: the trainer pool runs training-only workers (and the critic and the reward
  model), a rollout pool (``rollout.*``) runs rollout-only workers. Both join one broadcast
  group; ``sync_weights`` sends on the trainer ranks and receives on the rollout ranks, the
  two waited on together. ``generate`` is the rollout group's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from rlframe.config import Config, Placement
from rlframe.config.placement import (
    PoolShape,
    resolve_actor_worker_cls,
    rollout_pool,
    trainer_pool,
)
from rlframe.config.served_models import ServedSpec, list_served_models
from rlframe.controller import roles
from rlframe.controller.placement import ResourcePool
from rlframe.controller.weight_group import WeightGroupSpec
from rlframe.controller.worker_group import WorkerGroup, wait_calls
from rlframe.core.protocol import Batch
from rlframe.core.registry import load_class
from rlframe.observability import startup
from rlframe.rollout.engine_client import EngineClient, connect_ray_replicas
from rlframe.rollout.served import (
    SERVED_WORKER_CLS,
    ServedModel,
    connect_served,
    derive_served_config,
)

WorkerEnv = Callable[[int], dict[str, str]]
"""The environment of a pool's workers, given its CPUs per process."""


@dataclass
class Workers:
    """The groups the loop drives and the weight seam between them."""

    actor: roles.ActorGroup
    critic: roles.CriticGroup | None
    reward_model: roles.RewardModelGroup | None
    generate: Callable[[Batch], Batch]
    sync_weights: Callable[[], int]
    """Moves the trained weights to the rollout engines; returns the new version."""
    push_current: Callable[[], int] | None
    """Separate placement: sends the current weights again (after start or a resume)."""
    read_sync_check: Callable[[], list[dict[str, Any] | None]]
    """Each rollout rank's receiver check of the last sync (the probe's verdict)."""
    engine: EngineClient
    """The request stream into the rollout engines (the ``generate`` group's)."""
    served: dict[str, ServedModel]
    """The frozen models served beside the policy (teachers, judges), by name."""


@dataclass
class Launch:
    """What :func:`start_workers` needs, and the pools and groups it started (for teardown:
    they are recorded as they start, so a failure half-way still tears them down)."""

    cfg: Config
    device: str
    model_path: str
    reward_model_path: str | None
    env: WorkerEnv
    pools: list[ResourcePool]
    groups: list[WorkerGroup]
    served_paths: dict[str, str] = field(default_factory=dict)
    """Each served model's resolved folder (``tiny:N`` built), by name."""
    served: list[ServedModel] = field(default_factory=list)
    """The streams into served models, closed before their groups shut down."""
    placement_s: float = 0.0
    """Seconds spent creating the pools' placement groups (a start-up phase of the driver)."""

    def create_pool(
        self, section: str, colocate: int, shape: PoolShape | None = None
    ) -> ResourcePool:
        """The pool of ``section`` (``trainer``, ``rollout``, or a served model's, whose
        ``shape`` is given)."""
        cfg = self.cfg
        if shape is None:
            shape = (
                trainer_pool(cfg.trainer)
                if section == "trainer"
                else rollout_pool(cfg.rollout, cfg.trainer)
            )
        pool = ResourcePool(
            nnodes=shape.nnodes,
            procs_per_node=shape.procs_per_node,
            device=self.device,
            cpus_per_proc=shape.cpus_per_proc,
            max_colocate=colocate,
            name="actor_rollout"
            if section == "trainer" and cfg.rollout.placement is Placement.colocated
            else section,
            section=section,
        )
        self.pools.append(pool)
        began = time.time()
        pool.create(timeout_s=self.cfg.ray.placement_timeout_s)
        self.placement_s += time.time() - began
        return pool

    def start(
        self,
        pool: ResourcePool,
        role: str,
        path: str,
        model: str,
        tp: int = 1,
        cfg: Config | None = None,
    ) -> tuple[Any, type]:
        """Start a group's actors without waiting for them: :meth:`wait_started` waits for
        every group started so far, so their constructors (imports, engines) run at once.
        ``cfg``: the workers' own view of the config (a served model's), default the run's."""
        worker_cls = load_class(path)
        group = WorkerGroup(
            pool,
            worker_cls,
            role=role,
            init_args=(cfg or self.cfg, model, self.device),
            call_timeout_s=self.cfg.ray.call_timeout_s,
            env=self.env(pool.cpus_per_proc),
            rollout_tp_size=tp,
            wait=False,
        )
        self.groups.append(group)
        return group, worker_cls

    def wait_started(self, alongside: Callable[[], None]) -> None:
        """Run ``alongside`` (the driver's own work) while the constructors of every group
        started run, then wait for them; record what each cost, from its rank 0's own clock
        (Python, imports, engines)."""
        alongside()
        waiting = [g for g in self.groups if g.started.outcome is None]
        wait_calls(*(g.started for g in waiting))
        for group in waiting:
            if "report_startup" in group.methods:  # a user's class may not derive from Worker
                report = group.report_startup()
                startup.DRIVER.attach("workers", report, prefix=f"{group.role} ")

    def connect_served(
        self, started: list[tuple[ServedSpec, roles.RolloutGroup]]
    ) -> dict[str, ServedModel]:
        models = [connect_served(spec, group, self.cfg) for spec, group in started]
        self.served += models
        return {m.spec.name: m for m in models}

    def shutdown(self) -> None:
        for model in self.served:
            model.close()
        for group in self.groups:
            group.shutdown()
        for pool in self.pools:
            pool.remove()


def start_workers(launch: Launch, alongside: Callable[[], None] = lambda: None) -> Workers:
    """Create the pools, start every group (all at once) and connect the weight seam.
    ``alongside`` runs on the driver while the workers construct."""
    cfg = launch.cfg
    served = list_served_models(cfg)
    # The critic, the reward model and colocated served models share the training bundles.
    colocate = (
        1
        + int(bool(cfg.critic.enable))
        + int(launch.reward_model_path is not None)
        + sum(spec.pool is None for spec in served)
    )
    train = launch.create_pool("trainer", colocate)
    tp = cfg.rollout.tensor_parallel_size
    if cfg.rollout.placement is Placement.colocated:
        group, cls = launch.start(train, "actor", cfg.actor.worker_cls, launch.model_path, tp)
        hybrid = roles.bind_role(group, roles.HybridGroup, cls)
        critic, reward_model = start_critic(launch, train), start_reward_model(launch, train)
        served_groups = start_served_models(launch, train, served)
        launch.wait_started(alongside)
        return Workers(
            hybrid,
            critic,
            reward_model,
            hybrid.generate,
            build_colocated_sync(hybrid),
            None,
            hybrid.read_sync_check,
            connect_engines(cfg, hybrid),
            launch.connect_served(served_groups),
        )
    group, cls = launch.start(
        train, "actor", resolve_actor_worker_cls(cfg.rollout, cfg.actor), launch.model_path
    )
    trainer = roles.bind_role(group, roles.TrainGroup, cls)
    critic, reward_model = start_critic(launch, train), start_reward_model(launch, train)
    pool = launch.create_pool("rollout", 1)
    group, cls = launch.start(pool, "rollout", cfg.rollout.worker_cls, launch.model_path, tp)
    rollout = roles.bind_role(group, roles.RolloutGroup, cls)
    served_groups = start_served_models(launch, train, served)
    launch.wait_started(alongside)
    join_weight_group(
        trainer, rollout, pick_weight_group_spec(trainer, rollout, lambda: train.find_free_port(0))
    )
    sync, push = build_broadcast_sync(trainer, rollout)
    return Workers(
        trainer,
        critic,
        reward_model,
        rollout.generate,
        sync,
        push,
        rollout.read_sync_check,
        connect_engines(cfg, rollout),
        launch.connect_served(served_groups),
    )


def start_served_models(
    launch: Launch, train: ResourcePool, specs: list[ServedSpec]
) -> list[tuple[ServedSpec, roles.RolloutGroup]]:
    """Start each served model's workers (not waited for): on a pool of its own, or on the
    trainer's bundles."""
    started = []
    for spec in specs:
        shape = spec.pool
        pool = train if shape is None else launch.create_pool(spec.name, 1, shape)
        derived = derive_served_config(launch.cfg, spec.serving, launch.served_paths[spec.name])
        group, cls = launch.start(
            pool,
            spec.name,
            SERVED_WORKER_CLS,
            launch.served_paths[spec.name],
            spec.serving.tensor_parallel_size,
            derived,
        )
        started.append((spec, roles.bind_role(group, roles.RolloutGroup, cls)))
    return started


def connect_engines(cfg: Config, group: roles.HybridGroup | roles.RolloutGroup) -> EngineClient:
    """The request stream into ``group``'s engines (one replica per tensor-parallel group)."""
    tp, timeout = cfg.rollout.tensor_parallel_size, cfg.ray.call_timeout_s
    return EngineClient(
        connect_ray_replicas(group.role, group.actors, tp, timeout), group.open_stream
    )


def start_critic(launch: Launch, pool: ResourcePool) -> roles.CriticGroup | None:
    if not launch.cfg.critic.enable:
        return None
    group, cls = launch.start(pool, "critic", launch.cfg.critic.worker_cls, launch.model_path)
    return roles.bind_role(group, roles.CriticGroup, cls)


def start_reward_model(launch: Launch, pool: ResourcePool) -> roles.RewardModelGroup | None:
    if launch.reward_model_path is None:
        return None
    path = launch.cfg.reward.model.worker_cls
    group, cls = launch.start(pool, "reward_model", path, launch.reward_model_path)
    return roles.bind_role(group, roles.RewardModelGroup, cls)


def build_colocated_sync(actor: roles.HybridGroup) -> Callable[[], int]:
    """Colocated placement: each hybrid rank copies its training weights into its own engine."""

    def sync_weights() -> int:
        return int(actor.sync_weights()[0])

    return sync_weights


def pick_weight_group_spec(
    trainer: roles.Group, rollout: roles.Group, find_port: Callable[[], tuple[str, int]]
) -> WeightGroupSpec:
    """The spec both pools join: trainer rank 0's node and a free port there (loopback when
    the cluster is this one node, so nothing listens on the network)."""
    host, port = find_port()
    one_node = sum(1 for n in ray.nodes() if n["Alive"]) == 1
    return WeightGroupSpec(
        "127.0.0.1" if one_node else host, port, trainer.world_size, rollout.world_size
    )


def join_weight_group(
    trainer: roles.TrainGroup, rollout: roles.RolloutGroup, spec: WeightGroupSpec
) -> None:
    """Every rank of both pools joins the broadcast group. Each join blocks until all ranks
    have joined, so both are started before either is waited on."""
    wait_calls(trainer.submit("init_weight_group", spec), rollout.submit("init_weight_group", spec))


def build_broadcast_sync(
    trainer: roles.TrainGroup, rollout: roles.RolloutGroup
) -> tuple[Callable[[], int], Callable[[], int]]:
    """``sync_weights`` (a new version: train ranks send, rollout ranks receive, waited on
    together so a death on either side ends the wait, named) and ``push_current`` (the
    current version again: after start or a resume)."""

    def move(bump_version: bool) -> int:
        sent, received = wait_calls(
            trainer.submit("send_weights", bump_version=bump_version),
            rollout.submit("receive_weights"),
        )
        if len({*sent, *received}) != 1:
            raise RuntimeError(f"weight sync versions disagree: sent {sent}, received {received}")
        return int(sent[0])

    return (lambda: move(True)), (lambda: move(False))
