"""Worker classes whose rollout engine loses the vision tower of one weight sync, for the
vision-language sync test.

The push of ``LOST_VERSION`` arrives whole except the vision tower and merger
(``visual.*``): the engine keeps its previous vision tower while the language model and
the version move on. A loader that skipped the vision names, or a sync that only walked the
language model, looks like this; ``rollout/logprob_diff`` must show it (the text-only sync
probe cannot). Load them with ``actor.worker_cls=`` (colocated) or ``rollout.worker_cls=``
(separate) and ship this module by value to the Ray workers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rlframe.config import Config
from rlframe.controller.dispatch import Dispatch, dispatch
from rlframe.models.hf_config import is_vision_tower_name
from workers.hybrid import HybridWorker
from workers.roles.rollout_role import RolloutRole
from workers.rollout_worker import RolloutWorker
from workers.sync.sync_probe import ProbeVerdict, SyncProbe
from workers.sync.weight_sync import InProcessSink

LOST_VERSION = 2
"""The version whose vision tower never reaches the engine (the sync after step 2): step 3
samples with it; the sync after step 3 delivers a whole model again."""


class VisionLosingRollout:
    """Stands in for a rollout role at a weight push: drops the vision tensors of
    ``LOST_VERSION`` (every bucket still crosses), loads everything else."""

    def __init__(self, role: RolloutRole) -> None:
        self.role = role

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if version == LOST_VERSION:
            weights = ((n, t) for n, t in weights if not is_vision_tower_name(n))
        self.role.load_weights(weights, version)

    def check_sync(self, probe: SyncProbe) -> ProbeVerdict:
        return self.role.check_sync(probe)


class LostVisionHybridWorker(HybridWorker):
    """The colocated worker, losing the vision tower of ``LOST_VERSION``."""

    def __init__(self, cfg: Config, model_path: str, device: str) -> None:
        super().__init__(cfg, model_path, device)
        self.sink = InProcessSink(VisionLosingRollout(self.rollout_role))  # type: ignore[arg-type]


class LostVisionRolloutWorker(RolloutWorker):
    """The separate pool's rollout worker, losing the vision tower of ``LOST_VERSION``."""

    @dispatch(Dispatch.ONE_TO_ALL)
    def receive_weights(self) -> int:
        if self.receiver is None:
            raise RuntimeError("receive_weights before init_weight_group")
        return self.receiver.pull(VisionLosingRollout(self.rollout_role))  # type: ignore[arg-type]
