"""The critic worker: a value model (HF backbone + scalar head) under FSDP2, for PPO/GAE.

It shares the actor's bundles and has its own process group. It is built from the training
role's blocks (:mod:`workers.roles.train_role`): the same FSDP2 engine and sharding, micro-batch
scoring, loss tail and checkpointing. It reads the actor's batch sizes and packing
(``actor.mini_batch_size``, ``actor.micro_batch_size``, ``actor.pack_sequences``...).
"""

from __future__ import annotations

import torch

from rlframe.algorithms.losses import LossScale, aggregate_loss, masked_mean
from rlframe.config import Config
from rlframe.controller.dispatch import Dispatch, dispatch
from rlframe.controller.worker import Worker
from rlframe.core.protocol import Batch
from rlframe.core.sequence_layout import build_layout
from rlframe.core.train_batch import FORWARD, VALUE_UPDATE, TrainBatch, need
from workers.roles.train_role import (
    backward_summed_over_ranks,
    count_optimizer_steps,
    score_micro_batches,
)
from workers.training.checkpointing import load_engine, save_engine
from workers.training.fsdp import FSDPEngine, OptimizerSpec, run_minibatch_updates
from workers.training.model_build import pick_dtype, resolve_packing


def compute_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, cliprange: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss per token, and where the clipped branch was taken.

    0.5 * max((V - R)^2, (V_clip - R)^2) with V_clip = V_old + clip(V - V_old, -c, c): the
    critic gains nothing by moving a value further than ``c`` in one step.
    """
    clipped = old_values + (values - old_values).clamp(-cliprange, cliprange)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped_loss, clipped_loss), (
        clipped_loss > unclipped_loss
    ).float()


class CriticWorker(Worker):
    """Args: the run's config, the resolved model directory, and ``cuda`` or ``cpu``."""

    def __init__(self, cfg: Config, model_path: str, device: str) -> None:
        super().__init__()
        self.cfg, self.device = cfg, device
        self.init_process_group(device)
        torch.manual_seed(cfg.trainer.seed)
        c = cfg.critic
        spec = OptimizerSpec(
            c.lr,
            c.weight_decay,
            c.grad_clip,
            c.lr_warmup_steps,
            "constant",
            count_optimizer_steps(cfg),
        )
        self.engine = FSDPEngine(
            model_path,
            cfg.model,
            spec,
            device,
            head="value",
            lora=cfg.critic.lora,
            sequence_parallel_size=c.sequence_parallel_size,
            expert_parallel_size=c.expert_parallel_size,
        )
        self.packed = resolve_packing(
            cfg.actor.pack_sequences, device, pick_dtype(cfg.model.dtype, device)
        )

    @dispatch(Dispatch.DP_SPLIT, reads=FORWARD)
    def compute_values(self, batch: TrainBatch) -> Batch:
        """[B, R] value of the state before each loss-mask token (0 elsewhere)."""
        values = score_micro_batches(
            self.engine, batch, self.cfg.actor, self.packed, self.engine.compute_token_values
        )
        return Batch({"values": values})

    @dispatch(Dispatch.DP_SPLIT, reads=VALUE_UPDATE)
    def update(self, batch: TrainBatch) -> dict[str, float]:
        """Regress values on the returns, with the actor's mini-batch and micro-batch sizes."""
        batch, _ = self.engine.gather_rows(batch, self.cfg.actor.mini_batch_size // self.world_size)
        return run_minibatch_updates(
            self.engine,
            batch,
            self.cfg.actor,
            self.world_size,
            forward_backward=self.forward_backward,
            prefix="critic",
            packed=self.packed,
        )

    def forward_backward(self, micro: TrainBatch, scale: LossScale) -> dict[str, float]:
        mask = micro.loss_mask.to(self.device)
        layout = build_layout(micro, self.packed)
        values = layout.to_grid(self.engine.compute_token_values(layout))
        token_loss, clipped = compute_value_loss(
            values,
            need(micro.values, "values").to(self.device),
            need(micro.returns, "returns").to(self.device),
            self.cfg.critic.cliprange_value,
        )
        loss = aggregate_loss(token_loss, mask, "token-mean", scale)
        backward_summed_over_ranks(loss, self.world_size)
        return {
            "critic/value_loss": float(masked_mean(token_loss.detach(), mask)),
            "critic/vf_clipfrac": float(masked_mean(clipped, mask)),
            "critic/vpred_mean": float(masked_mean(values.detach(), mask)),
        }

    @dispatch(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Write this rank's shards of the value model, its optimizer and LR schedule."""
        save_engine(self.engine, path)

    @dispatch(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        load_engine(self.engine, path)
