"""Which silent ranks are stopped processes.

When calls are waited on together (a weight sync: the trainer sends, the rollout ranks
receive) and one side fails or runs past its deadline, the other side's silent ranks may be
blocked in the collective with it, or be the ones holding everyone up. A process stopped by
SIGSTOP (or held by a debugger) is the second kind and is the one to name: a rollout worker
stopped during a sync left the trainer's ``send_weights`` to time out, and the run named the
trainer.

A process's state is read from ``/proc/<pid>/stat`` on its node by a task pinned there, so a
rank on another node is probed as well.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

STOPPED_STATES = ("T", "t")
"""``/proc/<pid>/stat`` states of a stopped process: by a signal, or traced by a debugger."""

PROBE_TIMEOUT_S = 30.0
"""Longest wait for the probe tasks (a task starts a worker process on a node that has none
idle)."""


@ray.remote(num_cpus=0)
def read_process_state(pid: int) -> str:
    """The state letter of process ``pid`` on this node; empty when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def locate_actor(actor: Any) -> tuple[str, int] | None:
    """(node id, pid) of an actor's process, or None when Ray does not say."""
    try:
        # Ray's public state API needs the dashboard, which runs only on request; the GCS
        # actor table it reads is there in every cluster.
        info = ray._private.state.actors(actor._actor_id.hex())
        return str(info["Address"]["NodeID"]), int(info["Pid"])
    except Exception:  # noqa: BLE001 - an unknown location only means no probe
        return None


def find_stopped_ranks(actors: dict[int, Any]) -> dict[int, int]:
    """rank -> pid of each of ``actors`` (rank -> actor handle) whose process is stopped."""
    located = {rank: locate_actor(actor) for rank, actor in actors.items()}
    probes = {
        read_process_state.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote(pid): (rank, pid)
        for rank, place in located.items()
        if place is not None
        for node, pid in [place]
    }
    if not probes:
        return {}
    ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=PROBE_TIMEOUT_S)
    stopped = {}
    for ref in ready:
        rank, pid = probes[ref]
        try:
            state = ray.get(ref)
        except Exception:  # noqa: BLE001 - a failed probe says nothing about the rank
            continue
        if state in STOPPED_STATES:
            stopped[rank] = pid
    return stopped
