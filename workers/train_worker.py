"""The training worker of a separate placement: the training role alone, no rollout engine.

Its weights reach a separate rollout pool (:class:`workers.rollout_worker.RolloutWorker`)
through a broadcast over a weight group that both pools join (``init_weight_group``). The
training endpoints are :class:`workers.train_endpoints.TrainEndpoints`'.
"""

from __future__ import annotations

from rlframe.config import Config
from rlframe.controller.dispatch import Dispatch, dispatch
from rlframe.controller.weight_group import WeightGroupSpec
from workers.sync.weight_sync import BroadcastSender, WeightGroup
from workers.train_endpoints import TrainEndpoints


class TrainWorker(TrainEndpoints):
    """Args: the run's config, the resolved model directory, and ``cuda`` or ``cpu``."""

    def __init__(self, cfg: Config, model_path: str, device: str) -> None:
        super().__init__(cfg, model_path, device)
        self.device = device
        # A sync may wait behind one whole call of the other pool (asynchronous separate
        # mode: the rollout pool finishes its running call first).
        self.sync_timeout_s = cfg.ray.call_timeout_s
        self.sender: BroadcastSender | None = None

    @dispatch(Dispatch.ONE_TO_ALL)
    def init_weight_group(self, spec: WeightGroupSpec) -> None:
        """Join the weight group as rank ``self.rank`` (trainer ranks come first). Blocks until
        every trainer and rollout rank has joined: call both pools' at the same time."""
        group = WeightGroup(spec, self.rank, self.device, self.sync_timeout_s)
        self.sender = BroadcastSender(group)

    @dispatch(Dispatch.ONE_TO_ALL)
    def send_weights(self, bump_version: bool = True) -> int:
        """Broadcast the policy's weights to the rollout pool (whose ranks must call
        ``receive_weights`` at the same time); returns the version sent. ``bump_version=False``
        re-sends the current version (after ``load_checkpoint``)."""
        if self.sender is None:
            raise RuntimeError("send_weights before init_weight_group")
        version = (
            self.train_role.publish_weights() if bump_version else self.train_role.weights_version
        )
        self.sender.push(self.train_role.weight_source(), version, self.sync_probe())
        return version
