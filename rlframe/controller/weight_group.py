"""Where the training ranks and a separate rollout pool meet to move weights.

The launcher picks one address and port and passes the same :class:`WeightGroupSpec` to both
groups' ``init_weight_group(spec)``. Trainer ranks are ranks ``0..trainer_world-1`` of that
torch.distributed group, rollout ranks ``trainer_world..trainer_world+rollout_world-1``.
The launcher's side (picking the address, joining, syncing) is in :mod:`rlframe.run.pools`; this
module stays light because the workers import the spec.
"""

from __future__ import annotations

from dataclasses import dataclass


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
