"""Where the training ranks and a separate rollout pool meet to move weights.

The launcher picks one address and port and passes the same :class:`WeightGroupSpec` to both
groups' ``init_weight_group(spec)``. Trainer ranks are ranks ``0..trainer_world-1`` of that
torch.distributed group, rollout ranks ``trainer_world..trainer_world+rollout_world-1``.
Then every sync is the trainer ranks' ``send_weights`` and the rollout ranks'
``receive_weights`` started together and waited on together.

Light on purpose (workers import the spec): Ray and the worker group load only when used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlframe.controller.roles import Group, RolloutGroup, TrainGroup

FindPort = Callable[[], tuple[str, int]]


@dataclass(frozen=True)
class WeightGroupSpec:
    master_addr: str
    """Address of the broadcast group's rendezvous (the node of trainer rank 0)."""
    master_port: int
    """A free port on ``master_addr`` for the rendezvous."""
    trainer_world: int
    """Training ranks in the group (the trainer pool's world size); they come first."""
    rollout_world: int
    """Rollout ranks in the group (the rollout pool's world size); they follow the trainers."""


def pick_weight_group_spec(trainer: Group, rollout: Group, find_port: FindPort) -> WeightGroupSpec:
    """The spec both pools join: trainer rank 0's node and a free port there (loopback when
    the cluster is this one node, so nothing listens on the network)."""
    import ray

    host, port = find_port()
    one_node = sum(1 for n in ray.nodes() if n["Alive"]) == 1
    return WeightGroupSpec(
        "127.0.0.1" if one_node else host, port, trainer.world_size, rollout.world_size
    )


def join_weight_group(trainer: TrainGroup, rollout: RolloutGroup, spec: WeightGroupSpec) -> None:
    """Every rank of both pools joins the broadcast group. Each join blocks until all ranks
    have joined, so both are started before either is waited on."""
    from rlframe.controller.worker_group import wait_calls

    wait_calls(trainer.submit("init_weight_group", spec), rollout.submit("init_weight_group", spec))


def build_broadcast_sync(
    trainer: TrainGroup, rollout: RolloutGroup
) -> tuple[Callable[[], int], Callable[[], int]]:
    """``sync_weights`` (a new version: train ranks send, rollout ranks receive, waited on
    together so a death on either side ends the wait, named) and ``push_current`` (the
    current version again: after start or a resume)."""
    from rlframe.controller.worker_group import wait_calls

    def move(bump_version: bool) -> int:
        sent, received = wait_calls(
            trainer.submit("send_weights", bump_version=bump_version),
            rollout.submit("receive_weights"),
        )
        if len({*sent, *received}) != 1:
            raise RuntimeError(f"weight sync versions disagree: sent {sent}, received {received}")
        return int(sent[0])

    return (lambda: move(True)), (lambda: move(False))
