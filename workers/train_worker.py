"""The training worker of a separate placement: the training role alone, no rollout engine.

Its weights reach a separate rollout pool (:class:`workers.rollout_worker.RolloutWorker`)
through a broadcast over a weight group that both pools join (``init_weight_group``).
"""

from __future__ import annotations

import torch

from rlframe.config import Config
from rlframe.controller import reads
from rlframe.controller.dispatch import Dispatch, dispatch
from rlframe.controller.weight_group import WeightGroupSpec
from rlframe.controller.worker import Worker
from rlframe.core.protocol import Batch, UpdateResult
from workers.roles.train_role import TrainRole
from workers.sync.weight_sync import BroadcastSender, WeightGroup


class TrainWorker(Worker):
    """Args: the run's config, the resolved model directory, and ``cuda`` or ``cpu``."""

    def __init__(self, cfg: Config, model_path: str, device: str) -> None:
        super().__init__()
        self.device = device
        # A sync may wait behind one whole call of the other pool (asynchronous separate
        # mode: the rollout pool finishes its running call first).
        self.sync_timeout_s = cfg.ray.call_timeout_s
        self.init_process_group(device)
        self.startup.mark("process_group")
        torch.manual_seed(cfg.trainer.seed)
        self.train_role = TrainRole(cfg, model_path, device, self.world_size)
        self.startup.mark("train_engine")
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
        lora = self.train_role.lora
        # LoRA syncs are where engines silently keep old weights: the receiver checks each.
        probe = self.train_role.compute_sync_probe() if lora.enabled and lora.verify_sync else None
        self.sender.push(self.train_role.weight_source(), version, probe)
        return version

    @dispatch(Dispatch.DP_SPLIT, reads=reads.POLICY_FORWARD)
    def compute_logprobs(self, batch: Batch) -> Batch:
        """The current policy's log-probs of the response tokens (``old_logprobs``)."""
        return Batch({"old_logprobs": self.train_role.compute_logprobs(batch)})

    @dispatch(Dispatch.DP_SPLIT, reads=reads.FORWARD)
    def compute_ref_logprobs(self, batch: Batch) -> Batch:
        """The frozen reference policy's log-probs of the response tokens."""
        return Batch({"ref_logprobs": self.train_role.compute_ref_logprobs(batch)})

    @dispatch(Dispatch.DP_SPLIT, reads=reads.POLICY_UPDATE)
    def update(self, batch: Batch) -> UpdateResult:
        """See :meth:`workers.roles.train_role.TrainRole.update`."""
        return self.train_role.update(batch)

    @dispatch(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Write this rank's shards of the policy, its optimizer and LR schedule into ``path``."""
        self.train_role.save(path)

    @dispatch(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int:
        """Load the policy's state; returns the saved weights version. The rollout pool still
        holds its own weights: follow with ``send_weights(bump_version=False)``."""
        return self.train_role.load(path)
