"""The rollout worker of a separate placement: the rollout role alone. It also serves the
frozen models of a run (teachers, judges: :mod:`rlframe.rollout.served`), never synced.

It receives the trainer's weights over the weight group both pools join
(``init_weight_group``) and stamps every row it generates with the version they carried.
"""

from __future__ import annotations

from typing import Any

import torch

from rlframe.config import Config
from rlframe.controller import reads
from rlframe.controller.dispatch import Dispatch, dispatch
from rlframe.controller.weight_group import WeightGroupSpec
from rlframe.controller.worker import Worker
from rlframe.core.protocol import Batch
from rlframe.rollout.turns import TurnRequest, TurnResult
from workers.roles.rollout_role import RolloutRole, read_verdict
from workers.sync.weight_sync import BroadcastReceiver, WeightGroup


class RolloutWorker(Worker):
    """Args: the run's config, the resolved model directory, and ``cuda`` or ``cpu``."""

    def __init__(self, cfg: Config, model_path: str, device: str) -> None:
        super().__init__()
        self.device = device
        # A sync may wait behind one whole call of the other pool.
        self.sync_timeout_s = cfg.ray.call_timeout_s
        # Before the engine: vLLM adopts this pool's process group as its world.
        self.init_process_group(device)
        self.startup.mark("process_group")
        torch.manual_seed(cfg.trainer.seed)
        self.rollout_role = RolloutRole(cfg, model_path, device, self.rank)
        self.startup.mark("rollout_engine")
        self.receiver: BroadcastReceiver | None = None

    @dispatch(Dispatch.ONE_TO_ALL)
    def init_weight_group(self, spec: WeightGroupSpec) -> None:
        """Join the weight group after the trainer ranks. Blocks until every rank has joined."""
        group = WeightGroup(spec, spec.trainer_world + self.rank, self.device, self.sync_timeout_s)
        self.receiver = BroadcastReceiver(group)

    @dispatch(Dispatch.ONE_TO_ALL)
    def receive_weights(self) -> int:
        """Load the weights trainer rank 0 broadcasts (``send_weights`` runs at the same
        time); returns their version, which every later row carries."""
        if self.receiver is None:
            raise RuntimeError("receive_weights before init_weight_group")
        return self.receiver.pull(self.rollout_role)

    @dispatch(Dispatch.ONE_TO_ALL)
    def read_sync_check(self) -> dict[str, Any] | None:
        """See :func:`workers.roles.rollout_role.read_verdict`."""
        return read_verdict(self.rollout_role)

    @dispatch(Dispatch.ROLLOUT_DP_SPLIT, reads=reads.GENERATE)
    def generate(self, prompts: Batch) -> Batch:
        """See :meth:`workers.roles.rollout_role.RolloutRole.generate` (the engine never sleeps
        here, so meta ``more_turns`` changes nothing)."""
        return self.rollout_role.generate(prompts)

    @dispatch(Dispatch.ONE_TO_ALL)
    def open_stream(self) -> None:
        """Wake the engine if it sleeps (a served model on the trainer's bundles sleeps
        while the policy trains); the policy's separate engine never sleeps."""
        if not self.rollout_role.awake:
            self.rollout_role.wake_up()

    @dispatch(Dispatch.ONE_TO_ALL)
    def sleep(self) -> None:
        """Free the device for training (a served model colocated with the trainer; its
        weights are kept: level 1). ``open_stream`` wakes it."""
        self.rollout_role.sleep()

    def serve(self, requests: list[TurnRequest]) -> list[TurnResult]:
        """One call of the request stream (:meth:`RolloutRole.serve`)."""
        return self.rollout_role.serve(requests)

    def abort_stream(self) -> list[TurnResult]:
        """The stream's pause (:meth:`RolloutRole.abort_stream`)."""
        return self.rollout_role.abort_stream()
