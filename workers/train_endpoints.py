"""What every worker that holds a training role serves the driver, written once.

:class:`TrainEndpoints` is the base of :class:`workers.hybrid.HybridWorker` (the training role
beside a rollout engine, colocated placement) and :class:`workers.train_worker.TrainWorker`
(the training role alone, separate placement). It starts the training role and holds the
``@dispatch`` methods of :class:`rlframe.controller.roles.ActorGroup` (log-probs, reference
log-probs, the update, checkpoints) and the rule of which weight syncs are verified. A
subclass adds its weight sync and says, through two hooks, what its rollout engine needs:
:meth:`TrainEndpoints.enter_train_mode` before each training call, and
:meth:`TrainEndpoints.weights_loaded` after a checkpoint is loaded.

The worker group finds inherited ``@dispatch`` methods as it finds a class's own (it reads
``dir()`` of the class), and Ray serves them on the actor alike.
"""

from __future__ import annotations

import torch

from rlframe.config import Config
from rlframe.controller.dispatch import Dispatch, dispatch
from rlframe.controller.worker import Worker
from rlframe.core.protocol import Batch, UpdateResult
from rlframe.core.train_batch import FORWARD, POLICY_FORWARD, POLICY_UPDATE, TrainBatch
from workers.roles.train_role import TrainRole
from workers.sync.sync_probe import SyncProbe


class TrainEndpoints(Worker):
    """Args: the run's config, the resolved model directory, and ``cuda`` or ``cpu``."""

    def __init__(self, cfg: Config, model_path: str, device: str) -> None:
        super().__init__()
        # Before any engine: vLLM adopts this process group as its world.
        self.init_process_group(device)
        self.startup.mark("process_group")
        torch.manual_seed(cfg.trainer.seed)
        self.train_role = TrainRole(cfg, model_path, device, self.world_size)
        self.startup.mark("train_engine")

    # -- hooks ---------------------------------------------------------------------------

    def enter_train_mode(self) -> None:
        """Ready the training role's state on the device before a training call; nothing to
        do without a rollout engine in the process."""

    def weights_loaded(self, version: int) -> None:
        """After :meth:`load_checkpoint`: nothing here. A separate rollout pool still holds
        its own weights: the driver follows with ``send_weights(bump_version=False)``."""

    # -- the verify-sync rule ------------------------------------------------------------

    @property
    def verifies_sync(self) -> bool:
        """Every sync is checked by the receiver (the probe), in every placement and mode,
        unless the sync check is off (``rollout.max_logprob_diff=0``) or, with LoRA,
        ``model.lora.verify_sync=false``."""
        cfg, lora = self.train_role.cfg, self.train_role.lora
        if cfg.rollout.max_logprob_diff == 0:
            return False
        return lora.verify_sync if lora.enabled else True

    def sync_probe(self) -> SyncProbe | None:
        """The trainer's side of the check of a sync (:meth:`TrainRole.compute_sync_probe`),
        or None when syncs are not verified."""
        return self.train_role.compute_sync_probe() if self.verifies_sync else None

    # -- endpoints -----------------------------------------------------------------------

    @dispatch(Dispatch.DP_SPLIT, reads=POLICY_FORWARD)
    def compute_logprobs(self, batch: TrainBatch) -> Batch:
        """The current policy's log-probs of the response tokens (``old_logprobs``)."""
        self.enter_train_mode()
        return Batch({"old_logprobs": self.train_role.compute_logprobs(batch)})

    @dispatch(Dispatch.DP_SPLIT, reads=FORWARD)
    def compute_ref_logprobs(self, batch: TrainBatch) -> Batch:
        """The frozen reference policy's log-probs of the response tokens."""
        self.enter_train_mode()
        return Batch({"ref_logprobs": self.train_role.compute_ref_logprobs(batch)})

    @dispatch(Dispatch.DP_SPLIT, reads=POLICY_UPDATE)
    def update(self, batch: TrainBatch) -> UpdateResult:
        """See :meth:`workers.roles.train_role.TrainRole.update`."""
        self.enter_train_mode()
        return self.train_role.update(batch)

    @dispatch(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Write this rank's shards of the policy, its optimizer and LR schedule into ``path``."""
        self.enter_train_mode()
        self.train_role.save(path)

    @dispatch(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int:
        """Load the policy's state from ``path``; returns the saved weights version, which
        :meth:`weights_loaded` gets first (a rollout engine in the process is loaded with
        those weights under that version)."""
        self.enter_train_mode()
        version = self.train_role.load(path)
        self.weights_loaded(version)
        return version
