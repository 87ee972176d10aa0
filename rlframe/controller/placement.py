"""Resource pools: Ray placement groups that worker groups are placed on.

A pool reserves ``procs_per_node`` bundles on each of ``nnodes`` nodes, one placement group
per node (STRICT_PACK keeps a node's bundles on that node). A bundle is one GPU plus some
CPUs on GPU nodes, or some CPUs on CPU-only machines. Roles that share a pool share its
bundles: each of them takes ``1 / max_colocate`` of every bundle, which is how the actor,
critic and reference of one rank end up on the same GPU. A role that needs its own devices
gets its own pool (split placement).

Rank ``r`` always lives in bundle ``r % procs_per_node`` of the ``r // procs_per_node``-th
node, nodes ordered by address, so rank order is the same on every run.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


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
    cpus_per_proc: float = 1.0
    """CPUs in each bundle."""
    max_colocate: int = 1
    """How many roles share each bundle; each takes this fraction of the bundle."""
    name: str = "pool"
    """Prefix of the placement group names (visible in the Ray dashboard)."""
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

    def create(self, timeout_s: float = 120.0) -> None:
        """Reserve the bundles. Fails with the cluster's resources if they cannot be had."""
        if self.placement_groups:
            return
        groups = [
            placement_group([self.bundle()] * self.procs_per_node, strategy="STRICT_PACK", name=f"{self.name}_{i}")
            for i in range(self.nnodes)
        ]
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout_s)
        if len(ready) < len(groups):
            for g in groups:
                ray.util.remove_placement_group(g)
            raise PlacementError(
                f"resource pool {self.name!r} needs {self.nnodes} node(s) x {self.procs_per_node} "
                f"bundle(s) of {self.bundle()}, which the cluster could not place within "
                f"{timeout_s:.0f} s. Cluster resources: {ray.cluster_resources()}. Lower "
                "trainer.procs_per_node / trainer.cpus_per_proc or add nodes."
            )
        self.placement_groups = sorted(groups, key=node_sort_key)

    def slots(self) -> list[tuple[PlacementGroup, int]]:
        """(placement group, bundle index) for each rank, in rank order."""
        if not self.placement_groups:
            raise RuntimeError(f"resource pool {self.name!r} is not created; call create() first")
        return [(g, i) for g in self.placement_groups for i in range(self.procs_per_node)]

    def scheduling(self, rank: int) -> PlacementGroupSchedulingStrategy:
        group, index = self.slots()[rank]
        return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)

    def find_master_address(self) -> tuple[str, int]:
        """Address and a free port on rank 0's node for torch.distributed rendezvous.

        A single-node pool rendezvouses on loopback: every rank is on that node, and no
        traffic needs to leave it.
        """
        host, port = ray.get(
            find_free_port.options(scheduling_strategy=self.scheduling(0)).remote(), timeout=60
        )
        return ("127.0.0.1" if self.nnodes == 1 else host), port

    def remove(self) -> None:
        for g in self.placement_groups:
            ray.util.remove_placement_group(g)
        self.placement_groups = []


def node_sort_key(group: PlacementGroup) -> tuple[str, str]:
    """Order placement groups by the address of the node holding their first bundle."""
    node_id = placement_group_table(group)["bundles_to_node_id"][0]
    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return addresses.get(node_id, ""), node_id


@ray.remote(num_cpus=0)
def find_free_port() -> tuple[str, int]:
    """Runs on the target node: its address and a port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port: Any = s.getsockname()[1]
    return ray.util.get_node_ip_address(), int(port)
