"""Two virtual Ray nodes on this machine (``ray.cluster_utils.Cluster``), driven from here.

``python tests/e2e/two_node_cluster.py RESULT.json [CLI override ...]``: starts a head node
and a second node with two CPUs each, places a real 2-node resource pool and reports where
its ranks landed, then runs ``python -m rlframe.main`` with the given overrides against the
cluster (``ray.address``) and writes everything to RESULT.json. Run as a separate process
because a pytest session may already be connected to another Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from rlframe.controller.dispatch import Dispatch, dispatch  # noqa: E402
from rlframe.controller.placement import ResourcePool  # noqa: E402
from rlframe.controller.worker import Worker  # noqa: E402
from rlframe.controller.worker_group import WorkerGroup  # noqa: E402


class ProbeWorker(Worker):
    """Reports where its rank runs (defined here, so Ray ships it by value)."""

    @dispatch(Dispatch.ONE_TO_ALL)
    def describe(self) -> dict[str, object]:
        master = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        node_id = ray.get_runtime_context().get_node_id()
        return {"rank": self.rank, "node_id": node_id, "master": master}


def place_pool() -> dict:
    """Where the ranks of ``trainer.nnodes=2 trainer.procs_per_node=1`` land."""
    pool = ResourcePool(nnodes=2, procs_per_node=1, device="cpu", cpus_per_proc=1)
    pool.create(timeout_s=60)
    group = WorkerGroup(pool, ProbeWorker, role="probe", call_timeout_s=120)
    try:
        return {
            "ranks": group.describe(),
            "nodes": [n["NodeID"] for n in ray.nodes() if n["Alive"]],
        }
    finally:
        group.shutdown()
        pool.remove()


def main() -> None:
    result_path, *overrides = sys.argv[1:]
    # Two CPUs per node: both one-CPU groups would fit on either node, so only the spreading
    # (not a lack of room) puts them on different nodes.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        placement = place_pool()
        ray.shutdown()
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        run = subprocess.run(
            [sys.executable, "-m", "rlframe.main", f"ray.address={cluster.address}", *overrides],
            capture_output=True,
            text=True,
            check=False,
            timeout=900,
            env=env,
        )
        Path(result_path).write_text(
            json.dumps(
                {
                    "placement": placement,
                    "returncode": run.returncode,
                    "stdout": run.stdout,
                    "stderr": run.stderr[-5000:],
                }
            )
        )
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
