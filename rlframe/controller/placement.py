"""Resource pools: Ray placement groups that worker groups are placed on.

A pool reserves ``procs_per_node`` bundles on each of ``nnodes`` distinct nodes, one placement
group per node (STRICT_PACK keeps a node's bundles on that node; the nodes are chosen by a
STRICT_SPREAD probe so that two groups never share a node). A bundle is one GPU plus some
CPUs on GPU nodes, or some CPUs on CPU-only machines. Roles that share a pool share its
bundles: each of them takes ``1 / max_colocate`` of every bundle, which is how the actor,
critic and reference of one rank end up on the same GPU. A role that needs its own devices
gets its own pool (split placement).

Rank ``r`` always lives in bundle ``r % procs_per_node`` of the ``r // procs_per_node``-th
node, nodes ordered by address, so rank order is the same on every run.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from dataclasses import dataclass, field
from typing import Any, cast

import ray
from ray.util.placement_group import (
    NODE_ID_LABEL_KEY,
    PlacementGroup,
    placement_group,
    placement_group_table,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """The cluster cannot hold the requested pool."""


@dataclass
class ResourcePool:
    nnodes: int
    """Nodes to spread the pool over; one placement group per node."""
    procs_per_node: int
    """Bundles (worker processes per role) on each node."""
    device: str
    """``cuda``: each bundle holds one GPU. ``cpu``: bundles hold CPUs only."""
    cpus_per_proc: int = 1
    """CPUs in each bundle (whole CPUs: the workers' OMP_NUM_THREADS is this number)."""
    max_colocate: int = 1
    """How many roles share each bundle; each takes this fraction of the bundle."""
    name: str = "pool"
    """Prefix of the placement group names (visible in the Ray dashboard)."""
    section: str = "trainer"
    """Config section whose ``nnodes``/``procs_per_node``/``cpus_per_proc`` size the pool
    (named in placement errors): ``trainer``, or ``rollout`` for a separate rollout pool."""
    placement_groups: list[PlacementGroup] = field(default_factory=list, init=False)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.procs_per_node

    def bundle(self) -> dict[str, float]:
        if self.device == "cuda":
            return {"CPU": self.cpus_per_proc, "GPU": 1}
        return {"CPU": self.cpus_per_proc}

    def actor_resources(self) -> dict[str, float]:
        """``num_cpus``/``num_gpus`` for one role's actor on one bundle."""
        share = {"num_cpus": self.cpus_per_proc / self.max_colocate}
        if self.device == "cuda":
            share["num_gpus"] = 1 / self.max_colocate
        return share

    def node_share(self) -> dict[str, float]:
        """What one node must hold: ``procs_per_node`` bundles."""
        return {k: v * self.procs_per_node for k, v in self.bundle().items()}

    def describe(self) -> str:
        return (
            f"resource pool {self.name!r} needs {self.nnodes} node(s) x {self.procs_per_node} "
            f"bundle(s) of {self.bundle()}"
        )

    def create(self, timeout_s: float = 600.0, report_every_s: float = 30.0) -> None:
        """Reserve the bundles, ``procs_per_node`` of them on each of ``nnodes`` distinct nodes.

        A request this cluster can never hold fails at once (:func:`check_placeable`); one
        that waits for resources in use, or for an autoscaler to add nodes, logs what it is
        waiting for every ``report_every_s`` and fails after ``timeout_s``.
        """
        if self.placement_groups:
            return
        check_placeable(self)
        if self.nnodes == 1:
            groups = [self.reserve_node(0, None)]
            self.wait_ready(groups, timeout_s, report_every_s)
        else:
            deadline = time.monotonic() + timeout_s
            nodes = self.pick_distinct_nodes(timeout_s, report_every_s)
            groups = [self.reserve_node(i, node) for i, node in enumerate(nodes)]
            self.wait_ready(groups, max(deadline - time.monotonic(), 1.0), report_every_s)
        self.placement_groups = sorted(groups, key=node_sort_key)

    def reserve_node(self, index: int, node_id: str | None) -> PlacementGroup:
        """One node's bundles in one STRICT_PACK group, pinned to ``node_id`` when given."""
        selector = [{NODE_ID_LABEL_KEY: node_id}] * self.procs_per_node if node_id else None
        # placement_group() is declared to return a PlacementGroup; ray's unannotated
        # client_mode_wrap decorator hides that from mypy.
        return cast(
            PlacementGroup,
            placement_group(
                [self.bundle()] * self.procs_per_node,
                strategy="STRICT_PACK",
                name=f"{self.name}_{index}",
                bundle_label_selector=selector,
            ),
        )

    def pick_distinct_nodes(self, timeout_s: float, report_every_s: float) -> list[str]:
        """``nnodes`` distinct nodes that can each hold a node's bundles.

        Separate STRICT_PACK groups may land on one node, so the nodes are chosen by a
        STRICT_SPREAD probe of one node-sized bundle per node (which an autoscaler also
        sees as demand); the probe is released and each node's group pinned to its node.
        """
        probe = placement_group(
            [self.node_share()] * self.nnodes, strategy="STRICT_SPREAD", name=f"{self.name}_probe"
        )
        self.wait_ready([probe], timeout_s, report_every_s)
        nodes = list(placement_group_table(probe)["bundles_to_node_id"].values())
        ray.util.remove_placement_group(probe)
        return nodes

    def wait_ready(
        self, groups: list[PlacementGroup], timeout_s: float, report_every_s: float
    ) -> None:
        deadline = time.monotonic() + timeout_s
        pending = [g.ready() for g in groups]
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                for g in groups:
                    ray.util.remove_placement_group(g)
                raise PlacementError(
                    f"{self.describe()}, which the cluster could not place within "
                    f"{timeout_s:.0f} s (free now: {free_resources()}; total: "
                    f"{total_resources()}). Free the resources, raise ray.placement_timeout_s, "
                    f"or lower {self.section}.procs_per_node / {self.section}.cpus_per_proc."
                )
            _, pending = ray.wait(
                pending, num_returns=len(pending), timeout=min(report_every_s, remaining)
            )
            if pending:
                logger.warning(
                    "waiting for placement: %s; %d of %d group(s) pending; free now: %s%s",
                    self.describe(),
                    len(pending),
                    len(groups),
                    free_resources(),
                    "; the autoscaler may add nodes"
                    if read_autoscaling_limits() is not None
                    else "",
                )

    def slots(self) -> list[tuple[PlacementGroup, int]]:
        """(placement group, bundle index) for each rank, in rank order."""
        if not self.placement_groups:
            raise RuntimeError(f"resource pool {self.name!r} is not created; call create() first")
        return [(g, i) for g in self.placement_groups for i in range(self.procs_per_node)]

    def scheduling(self, rank: int) -> PlacementGroupSchedulingStrategy:
        group, index = self.slots()[rank]
        return PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=index
        )

    def find_master_address(self) -> tuple[str, int]:
        """Address and a free port on rank 0's node for torch.distributed rendezvous.

        A single-node pool rendezvouses on loopback: every rank is on that node, and no
        traffic needs to leave it.
        """
        host, port = self.find_free_port(0)
        return ("127.0.0.1" if self.nnodes == 1 else host), port

    def find_free_port(self, rank: int) -> tuple[str, int]:
        """The address of rank ``rank``'s node and a port that was free there a moment ago.

        On the driver's own node (every single-node run) the driver binds the port itself:
        a Ray task for it once aborted in Ray's core worker ("Mutex corrupt", 13 lines on the
        console) and cost a worker process. On another node a task there finds it, retried
        if its worker process dies."""
        group, index = self.slots()[rank]
        node = placement_group_table(group)["bundles_to_node_id"][index]
        if node == ray.get_runtime_context().get_node_id():
            return bind_free_port()
        task = find_free_port_task.options(
            scheduling_strategy=self.scheduling(rank), max_retries=PORT_TASK_RETRIES
        )
        return cast(tuple[str, int], ray.get(task.remote(), timeout=60))

    def remove(self) -> None:
        for g in self.placement_groups:
            ray.util.remove_placement_group(g)
        self.placement_groups = []


def check_placeable(pool: ResourcePool) -> None:
    """Raise :class:`PlacementError` at once when the cluster can never hold ``pool``.

    A fixed cluster (no autoscaler configured) can never hold it when fewer than ``nnodes``
    of its live nodes have, in total, the resources of ``procs_per_node`` bundles. An
    autoscaling cluster can when its node types allow ``nnodes`` such nodes.
    """
    need = pool.node_share()
    nodes = [n for n in ray.nodes() if n["Alive"]]
    capable = [n for n in nodes if fits(need, n["Resources"])]
    if len(capable) >= pool.nnodes:
        return
    limits = read_autoscaling_limits()
    if (
        limits is not None
        and sum(count for resources, count in limits if fits(need, resources)) >= pool.nnodes
    ):
        return
    largest = max(
        (node_summary(n["Resources"]) for n in nodes), key=lambda r: tuple(r.values()), default={}
    )
    why = (
        f"no node has that much (largest node: {largest})"
        if not capable
        else f"only {len(capable)} node(s) of {len(nodes)} can hold {need}"
    )
    keys = "/".join(f"{pool.section}.{k}" for k in ("procs_per_node", "cpus_per_proc", "nnodes"))
    raise PlacementError(
        f"{pool.describe()} ({need} per node), which the cluster could not place and never "
        f"can: {why}. Lower {keys} or add nodes."
    )


def fits(need: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) >= v for k, v in need.items())


def node_summary(resources: dict[str, float]) -> dict[str, float]:
    return {k: resources[k] for k in ("CPU", "GPU") if k in resources}


def read_autoscaling_limits() -> list[tuple[dict[str, float], float]] | None:
    """(resources of a node type, most nodes of that type) per node type of an autoscaling
    cluster; None for a fixed cluster (no autoscaler config published to the GCS)."""
    try:
        config = ray._private.state.state.get_cluster_config()
    except Exception:  # noqa: BLE001 - older Ray or a client connection: treat as fixed
        return None
    if config is None or not config.node_group_configs:
        return None
    return [
        (dict(group.resources), math.inf if group.max_count == -1 else float(group.max_count))
        for group in config.node_group_configs
    ]


def free_resources() -> dict[str, float]:
    return node_summary(ray.available_resources())


def total_resources() -> dict[str, float]:
    return node_summary(ray.cluster_resources())


def node_sort_key(group: PlacementGroup) -> tuple[str, str]:
    """Order placement groups by the address of the node holding their first bundle."""
    node_id = placement_group_table(group)["bundles_to_node_id"][0]
    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return addresses.get(node_id, ""), node_id


PORT_TASK_RETRIES = 3
"""Retries of the port task when its worker process dies (the task has no side effects)."""


def bind_free_port() -> tuple[str, int]:
    """This node's address and a port that was free on it a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port: Any = s.getsockname()[1]
    return ray.util.get_node_ip_address(), int(port)


find_free_port_task = ray.remote(num_cpus=0)(bind_free_port)
""":func:`bind_free_port` run on another node."""
