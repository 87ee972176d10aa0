"""The training role: the policy under FSDP2 with its optimizer, and the frozen reference.

It computes log-probs, runs the PPO-style update, saves and loads its state, and is the
source of the weights that a sink loads into a rollout engine. It owns the version of the
weights it has published. A worker composes it with a rollout role in one process
(:class:`workers.hybrid.HybridWorker`) or runs it alone (:class:`workers.train_worker.TrainWorker`).

The module-level building blocks (micro-batch scoring, the loss tail, the step count) are
shared with the critic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial

import torch
from torch import nn

from rlframe.algorithms.losses import POLICY_LOSSES, LossScale
from rlframe.algorithms.off_policy import OldLogprobs, pick_old_logprobs
from rlframe.algorithms.policy_objective import (
    TOPK_FORWARD_KL,
    PolicyTerms,
    compose_policy_loss,
)
from rlframe.algorithms.router import (
    GroupSum,
    compute_load_balancing_loss,
    summarize_routing,
)
from rlframe.config import ActorConfig, Config
from rlframe.config.agent import compute_response_width
from rlframe.config.lora import LoraConfig, LoraSync
from rlframe.core.names import RouterReplay
from rlframe.core.protocol import UpdateResult
from rlframe.core.sequence_layout import SequenceLayout, build_layout
from rlframe.core.train_batch import TrainBatch, need
from rlframe.distill.objectives import pick_distill_term
from workers.model_hooks.router_logits import find_router_spec, record_router_logits
from workers.model_hooks.vision import ImageEncoder, build_image_encoder
from workers.sync.sync_probe import (
    PROBE_LENGTH,
    SyncProbe,
    build_probe_ids,
    compute_trainer_probe,
    list_vision_token_ids,
)
from workers.sync.weight_sync import WeightSource, iter_full_tensors
from workers.training.checkpointing import load_engine, save_engine
from workers.training.fsdp import (
    FSDPEngine,
    OptimizerSpec,
    run_minibatch_updates,
    split_micro_batches,
)
from workers.training.lora import adapters_disabled, iter_adapter_tensors, iter_merged_tensors
from workers.training.model_build import pick_dtype, resolve_packing
from workers.training.ulysses import slice_token_mask, sum_over_ranks


def count_optimizer_steps(cfg: Config) -> int:
    """Optimizer steps in the whole run (for the learning-rate schedule)."""
    responses = cfg.data.batch_size * cfg.rollout.n
    return cfg.trainer.total_steps * cfg.actor.epochs * (responses // cfg.actor.mini_batch_size)


def check_single_pass(rows: int, cfg: ActorConfig, world_size: int) -> None:
    """Log-probs taken during an update are the old ones only if no step came before them
    (the driver's rule, :meth:`~rlframe.config.ActorConfig.updates_in_one_pass`, on all
    ranks' rows; the config checks that the world size divides the mini-batch)."""
    if not cfg.updates_in_one_pass(rows * world_size):
        raise ValueError(
            "an update without old_logprobs must be exactly on-policy (actor.epochs=1 and one "
            f"mini-batch): got epochs={cfg.epochs}, {rows} rows for mini-batches of "
            f"{cfg.mini_batch_size // world_size} per rank; compute old log-probs first "
            "(compute_logprobs)"
        )


def build_optimizer_spec(cfg: ActorConfig, total_steps: int) -> OptimizerSpec:
    return OptimizerSpec(
        cfg.lr, cfg.weight_decay, cfg.grad_clip, cfg.warmup_steps, cfg.lr_schedule, total_steps
    )


@torch.no_grad()
def score_micro_batches(
    engine: FSDPEngine,
    batch: TrainBatch,
    sizes: ActorConfig,
    packed: bool,
    score: Callable[[SequenceLayout], torch.Tensor],
    images: ImageEncoder | None = None,
) -> torch.Tensor:
    """[B, R] per-token scores of the loss-mask tokens (0 elsewhere): ``score(layout)`` gives
    the [N] values of one micro-batch's selected tokens (log-probs, values). A
    sequence-parallel group scores its ranks' rows together; each rank returns its own.
    ``images``: a vision-language model's encoder of the rows' images."""
    engine.model.eval()
    batch, own_rows = engine.gather_rows(batch, block=len(batch))
    out = torch.zeros(batch.response_ids.shape)
    batch = replace(batch, row_index=torch.arange(len(batch)))
    sp_size = engine.sequence_parallel_size
    for micro in split_micro_batches(batch, sizes, engine.device, packed, sp_size):
        layout = build_layout(micro, packed, None if images is None else images.encode(micro))
        out[need(micro.row_index, "row_index")] = layout.to_grid(score(layout).cpu())
    return out[own_rows]


def backward_summed_over_ranks(loss: torch.Tensor, world_size: int) -> None:
    """Backward of a rank's share of the mini-batch loss.

    FSDP averages gradients over ranks; the loss shares sum to the mini-batch loss over
    ranks, so scale by the world size to turn that average into the sum.
    """
    (loss * world_size).backward()


def pick_sync_tensors(
    lora: LoraConfig, freeze_vision: bool = False
) -> Callable[[nn.Module], Iterator[tuple[str, torch.Tensor]]]:
    """What a weight sync streams: every tensor (but a frozen vision tower's), or under LoRA
    the merged weights (``sync=merged``) or the adapters alone (``sync=adapter``)."""
    if not lora.enabled:
        return partial(iter_full_tensors, with_vision=not freeze_vision)
    return iter_adapter_tensors if lora.sync is LoraSync.adapter else iter_merged_tensors


def weigh_router_loss(
    rows: float, scale: LossScale, device: torch.device, group_sum: GroupSum | None
) -> float:
    """The weight of a micro-step's load-balancing loss in its mini-batch's: the rows it
    covers over the mini-batch's. ``rows`` is this rank's share (a sequence group's rows
    divided among its ranks); with ``group_sum`` the micro-step is every rank's, and so is
    the weight, on every rank alike: each rank's backward then takes the union's loss's
    gradient for its own tokens, and the ranks' gradients add up to the union's."""
    if group_sum is None:
        return rows / scale.sequences
    total = group_sum(torch.tensor([rows], dtype=torch.float64, device=device))
    return float(total) / scale.sequences


class TrainRole:
    """Args: the run's config, the model directory, ``cuda`` or ``cpu``, and the size of
    the training group (the default process group, already joined)."""

    def __init__(self, cfg: Config, model_path: str, device: str, world_size: int) -> None:
        self.cfg, self.device, self.world_size = cfg, device, world_size
        spec = build_optimizer_spec(cfg.actor, count_optimizer_steps(cfg))
        self.lora = cfg.model.lora
        sp_size = cfg.actor.sequence_parallel_size
        self.actor = FSDPEngine(
            model_path,
            cfg.model,
            spec,
            device,
            lora=self.lora,
            sequence_parallel_size=sp_size,
            router_replay=cfg.algorithm.router_replay is RouterReplay.rollout,
            expert_parallel_size=cfg.actor.expert_parallel_size,
        )
        # Under LoRA the reference is the policy with its adapters off: no second copy.
        self.ref = (
            FSDPEngine(
                model_path,
                cfg.model,
                None,
                device,
                sequence_parallel_size=sp_size,
                expert_parallel_size=cfg.actor.expert_parallel_size,
            )
            if cfg.algorithm.uses_reference and not self.lora.enabled
            else None
        )
        self.policy_loss = POLICY_LOSSES.get(cfg.algorithm.policy_loss)
        self.packed = resolve_packing(
            cfg.actor.pack_sequences, device, pick_dtype(cfg.model.dtype, device)
        )
        self.weights_version = 0
        """The version of the last published weights (0: the checkpoint's)."""
        self.router = find_router_spec(self.actor.model)
        """Where a mixture-of-experts policy's router logits come from; None for dense ones."""
        self.images = build_image_encoder(model_path, self.actor.model.config)
        """A vision-language model's image encoder (None for a text model)."""

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, R] log-probs of the current policy (``old_logprobs``)."""
        return self.score_logprobs(self.actor, batch)

    def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, R] log-probs of the frozen reference policy."""
        if self.lora.enabled:
            # The reference's rows carry no routed experts (core/train_batch.py: FORWARD), and
            # the frozen base is no policy whose routing a rollout recorded.
            with adapters_disabled(self.actor.model), self.actor.routing_freely():
                return self.score_logprobs(self.actor, batch)
        if self.ref is None:
            raise RuntimeError(
                "compute_ref_logprobs needs a reference model: set algorithm.kl_coef or "
                "algorithm.kl_reward_coef > 0"
            )
        return self.score_logprobs(self.ref, batch)

    def score_logprobs(self, engine: FSDPEngine, batch: TrainBatch) -> torch.Tensor:
        a = self.cfg.actor

        def score(layout: SequenceLayout) -> torch.Tensor:
            temperature = self.cfg.rollout.temperature
            return engine.compute_token_logprobs(
                layout, temperature, a.logprob_chunk_size, False
            ).logprobs

        return score_micro_batches(engine, batch, a, self.packed, score, self.images)

    def update(self, batch: TrainBatch) -> UpdateResult:
        """PPO-style updates (epochs x mini-batches x micro-batches) on this rank's share.

        A batch without ``old_logprobs`` is an exactly on-policy step (one epoch, one
        mini-batch): the old log-probs are the update's own, detached, and come back as
        ``own_logprobs`` ([rows, R], this rank's rows in order) beside the metrics. With
        ``algorithm.off_policy_correction=rollout`` the old log-probs are always the batch's
        ``rollout_logprobs``.
        """
        own: torch.Tensor | None = None
        correction = self.cfg.algorithm.off_policy_correction
        brought = batch.old_logprobs is not None
        needs_own = pick_old_logprobs(correction, brought) is OldLogprobs.update
        if needs_own:
            check_single_pass(len(batch), self.cfg.actor, self.world_size)
        # A sequence-parallel group updates on its ranks' rows together, mini-batch by
        # mini-batch as the ranks would have.
        batch, own_rows = self.actor.gather_rows(
            batch, block=self.cfg.actor.mini_batch_size // self.world_size
        )
        if self.actor.replay is not None:
            self.actor.replay.take_agreement()  # counted by the log-prob pass: not this update's
        if needs_own:
            batch = replace(batch, row_index=torch.arange(len(batch)))
            own = torch.zeros(batch.response_ids.shape)
        metrics = run_minibatch_updates(
            self.actor,
            batch,
            self.cfg.actor,
            self.world_size,
            forward_backward=partial(self.forward_backward, own_logprobs=own),
            prefix="actor",
            packed=self.packed,
        )
        return UpdateResult(dict(metrics), None if own is None else own[own_rows])

    def forward_backward(
        self, micro: TrainBatch, scale: LossScale, own_logprobs: torch.Tensor | None = None
    ) -> dict[str, float]:
        """One micro-batch's forward, its loss (:func:`compose_policy_loss`) and backward.
        ``own_logprobs`` ([rows, R] of the whole update) receives this micro-batch's detached
        log-probs when the batch has no old ones. Under router replay also
        ``actor/routing_agreement``: the share of (token, MoE layer) pairs whose router, left
        alone, would have chosen the experts the rollout recorded."""
        layout = build_layout(
            micro, self.packed, None if self.images is None else self.images.encode(micro)
        )
        # Replayed routing covers the backward too: gradient checkpointing re-runs the routers.
        with self.actor.replaying(layout):
            metrics = self.run_forward_backward(micro, layout, scale, own_logprobs)
        if self.actor.replay is not None:
            agreement = self.actor.replay.take_agreement()
            if agreement is not None:
                metrics["actor/routing_agreement"] = agreement
        return metrics

    def run_forward_backward(
        self,
        micro: TrainBatch,
        layout: SequenceLayout,
        scale: LossScale,
        own_logprobs: torch.Tensor | None,
    ) -> dict[str, float]:
        cfg, a = self.cfg.algorithm, self.cfg.actor
        distill = pick_distill_term(self.cfg.distill)
        # The top-k objective reads the policy's log-probs of the teacher's top-k ids too.
        top_ids = (
            layout.from_grid(need(micro.teacher_top_ids, "teacher_top_ids"))
            if distill is not None and distill.estimator == TOPK_FORWARD_KL
            else None
        )
        with self.recording_routers() as router_logits:
            token = self.actor.compute_token_logprobs(
                layout,
                self.cfg.rollout.temperature,
                a.logprob_chunk_size,
                with_entropy=True,
                entropy_grad=cfg.entropy_coef > 0,
                extra_ids=top_ids,
            )

        if token.entropy is None:  # asked for above: the loss's entropy term and metric
            raise RuntimeError("compute_token_logprobs returned no entropy")

        def move(grid: torch.Tensor | None) -> torch.Tensor | None:
            return None if grid is None else grid.to(self.device)

        composed = compose_policy_loss(
            PolicyTerms(
                logprobs=layout.to_grid(token.logprobs),
                entropy=layout.to_grid(token.entropy),
                advantages=need(micro.advantages, "advantages").to(self.device),
                loss_mask=micro.loss_mask.to(self.device),
                scale=scale,
                old_logprobs=move(micro.old_logprobs),
                rollout_logprobs=move(micro.rollout_logprobs),
                ref_logprobs=move(micro.ref_logprobs),
                teacher_logprobs=move(micro.teacher_logprobs),
                teacher_top_logprobs=move(micro.teacher_top_logprobs),
                student_top_logprobs=None if token.extra is None else layout.to_grid(token.extra),
            ),
            cfg,
            self.policy_loss,
            distill,
        )
        if own_logprobs is not None:
            own_logprobs[need(micro.row_index, "row_index")] = composed.old_logprobs.cpu()
        loss, metrics = composed.loss, composed.metrics
        if router_logits:
            loss, metrics = self.add_router_terms(
                loss, metrics, router_logits, layout, micro, scale
            )
        backward_summed_over_ranks(loss, self.world_size)
        return metrics

    @contextmanager
    def recording_routers(self) -> Iterator[list[torch.Tensor]]:
        """The router logits of the forward inside the block (none for a dense policy)."""
        if self.router is None:
            yield []
            return
        with record_router_logits(self.actor.model, self.router) as recorded:
            yield recorded

    def add_router_terms(
        self,
        loss: torch.Tensor,
        metrics: dict[str, float],
        router_logits: list[torch.Tensor],
        layout: SequenceLayout,
        micro: TrainBatch,
        scale: LossScale,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss plus ``algorithm.router_aux_loss_coef`` x the routers' load-balancing
        loss, and the expert-load metrics, over every real token the routers saw (prompt and
        response; padding left out) in this micro-step on *every* rank: the statistics are
        summed over the training ranks (data, sequence and expert parallel alike) before any
        ratio is taken, so the loss is the one a single rank computes on the union of the
        ranks' micro-batches, not a mean of per-rank losses (Switch's loss is not linear in
        its tokens: a rank's own balance is not the batch's). Its weight is the union's rows
        over the mini-batch's rows (see :func:`weigh_router_loss`)."""
        assert self.router is not None
        sp = self.actor.sp
        if sp is not None:
            # The routers saw this rank's slice: count its real tokens only.
            mask = slice_token_mask(layout, sp)
        elif layout.attention_mask is not None:
            mask = layout.attention_mask.reshape(-1)
        else:  # packed rows: no padding
            mask = torch.ones(router_logits[0].shape[0], device=router_logits[0].device)
        group_sum = sum_over_ranks if self.world_size > 1 else None
        top_k = self.router.top_k
        aux = compute_load_balancing_loss(router_logits, top_k, mask, group_sum)
        coef = self.cfg.algorithm.router_aux_loss_coef
        if coef > 0:
            rows = len(micro) / self.actor.sequence_parallel_size
            weight = weigh_router_loss(rows, scale, router_logits[0].device, group_sum)
            loss = loss + coef * aux * weight
        routing = summarize_routing(router_logits, top_k, mask, group_sum)
        return loss, metrics | routing | {"actor/router_aux_loss": float(aux.detach())}

    def weight_source(self) -> WeightSource:
        """The policy's weights in sync buckets, cast to the rollout engine's dtype."""
        bucket_bytes = self.cfg.rollout.weight_sync_bucket_mb * 2**20
        return WeightSource(
            self.actor.model,
            bucket_bytes,
            pick_dtype(self.cfg.model.dtype, self.device),
            pick_sync_tensors(self.lora, self.cfg.model.freeze_vision),
        )

    def compute_sync_probe(self) -> SyncProbe:
        """The trainer's log-probs of the fixed probe, for the receiver check of a sync."""
        config = self.actor.model.config
        # No longer than the engine's context (vLLM refuses a prompt that fills it).
        r = self.cfg.rollout
        context = self.cfg.data.max_prompt_length + compute_response_width(
            r.max_tokens, r.agent, self.cfg.agent
        )
        ids = build_probe_ids(
            int(config.get_text_config().vocab_size),
            list_vision_token_ids(config),
            min(PROBE_LENGTH, context - 1),
        )
        return SyncProbe(ids, compute_trainer_probe(self.actor.model, ids, self.device))

    def publish_weights(self) -> int:
        """A new weights version for the weights as they are now (after an update)."""
        self.weights_version += 1
        return self.weights_version

    def offload(self) -> None:
        """Free the device for the rollout engine (``actor.offload``; cuda only)."""
        if self.cfg.actor.offload:
            for engine in self.list_engines():
                engine.offload()

    def reload(self) -> None:
        if self.cfg.actor.offload:
            for engine in self.list_engines():
                engine.reload()

    def list_engines(self) -> list[FSDPEngine]:
        """The policy and, when there is one, the reference: both leave the device."""
        return [self.actor] + ([self.ref] if self.ref is not None else [])

    def save(self, path: str) -> None:
        """This rank's shards of the policy, its optimizer and LR schedule, and the weights
        version. The reference is not saved: it is the initial model, rebuilt at start."""
        save_engine(self.actor, path, {"weights_version": self.weights_version})

    def load(self, path: str) -> int:
        """Load what :meth:`save` wrote; returns the restored weights version."""
        extra = load_engine(self.actor, path, {"weights_version": 0})
        self.weights_version = int(extra["weights_version"])
        return self.weights_version
