"""Worker classes whose rollout engine loses one weight sync, for the sync-check test.

The lost sync completes as far as anyone can tell: the trainer publishes the new version,
every tensor crosses (a separate pool's broadcast is a collective: each rank takes part), and
the engine reports the new version; only its weights stay the old ones. That is how a broken
sync looks in a run (an adapter never delivered, a loader that skips a tensor), and what
``rollout/logprob_diff`` must show. Load them with ``actor.worker_cls=`` (colocated) or
``rollout.worker_cls=`` (separate) and ship this module by value to the Ray workers, which
cannot import the tests package.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rlframe.config import Config
from rlframe.controller.dispatch import Dispatch, dispatch
from workers.hybrid import HybridWorker
from workers.roles.rollout_role import RolloutRole
from workers.rollout_worker import RolloutWorker
from workers.sync.sync_probe import ProbeVerdict, SyncProbe
from workers.sync.weight_sync import InProcessSink

LOST_VERSION = 2
"""The weights version that never reaches the engine (the sync after step 2): colocated at
``max_staleness=1``, the engine samples on versions 0, 2, 4 (one generation phase every
second step, for two steps' groups)."""


class LosingRollout:
    """Stands in for a rollout role at a weight push: drops the tensors of ``LOST_VERSION``
    while recording its version, loads every other push."""

    def __init__(self, role: RolloutRole) -> None:
        self.role = role

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if version != LOST_VERSION:
            self.role.load_weights(weights, version)
            return
        for _ in weights:  # every bucket still crosses: the senders' collectives go on
            pass
        self.role.weights_version = version

    def check_sync(self, probe: SyncProbe) -> ProbeVerdict:
        return self.role.check_sync(probe)


class LostSyncHybridWorker(HybridWorker):
    """The colocated worker, with the engine losing the weights of ``LOST_VERSION``."""

    def __init__(self, cfg: Config, model_path: str, device: str) -> None:
        super().__init__(cfg, model_path, device)
        self.sink = InProcessSink(LosingRollout(self.rollout_role))  # type: ignore[arg-type]


class LostSyncRolloutWorker(RolloutWorker):
    """The separate pool's rollout worker, losing the weights of ``LOST_VERSION``."""

    @dispatch(Dispatch.ONE_TO_ALL)
    def receive_weights(self) -> int:
        if self.receiver is None:
            raise RuntimeError("receive_weights before init_weight_group")
        return self.receiver.pull(LosingRollout(self.rollout_role))  # type: ignore[arg-type]
