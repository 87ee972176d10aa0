"""The hybrid actor/rollout/reference worker: one per bundle, one class for the role.

Each rank holds the policy under FSDP2 (training engine), a rollout engine for the same
model (vLLM by default) and, when a KL term is on, a frozen reference copy. It switches
between rollout mode (engine awake, FSDP state optionally offloaded) and train mode (engine
asleep) around each stage, so the device never holds both working sets at once.
"""

from __future__ import annotations

import torch

from rlframe.algorithms.losses import (
    POLICY_LOSSES,
    LossScale,
    PolicyLossInputs,
    aggregate_loss,
    compute_kl,
    masked_mean,
)
from rlframe.algorithms.mismatch import compute_mismatch_weights, is_mismatch_correction_on
from rlframe.config import ActorConfig, Config, RolloutEngineName
from rlframe.config.agent import compute_response_width
from rlframe.controller.dispatch import Dispatch, dispatch
from rlframe.controller.worker import Worker
from rlframe.protocol import Batch
from rlframe.sequence_layout import build_layout
from workers.engines.base import RolloutEngine, SamplingSpec
from workers.engines.checkpointing import load_engine, save_engine
from workers.engines.fsdp import (
    FSDPEngine,
    OptimizerSpec,
    pick_dtype,
    resolve_packing,
    run_minibatch_updates,
    split_micro_batches,
)


def count_optimizer_steps(cfg: Config) -> int:
    """Optimizer steps in the whole run (for the learning-rate schedule)."""
    responses = cfg.data.batch_size * cfg.rollout.n
    return cfg.trainer.total_steps * cfg.actor.epochs * (responses // cfg.actor.mini_batch_size)


def check_single_pass(rows: int, cfg: ActorConfig, world_size: int) -> None:
    """Log-probs taken during an update are the old ones only if no step came before them."""
    if cfg.epochs != 1 or rows > cfg.mini_batch_size // world_size:
        raise ValueError(
            "an update without old_logprobs must be exactly on-policy (actor.epochs=1 and one mini-batch): "
            f"got epochs={cfg.epochs}, {rows} rows for mini-batches of {cfg.mini_batch_size // world_size} per rank; "
            "compute old log-probs first (compute_logprobs)"
        )


def build_optimizer_spec(cfg: ActorConfig, total_steps: int) -> OptimizerSpec:
    return OptimizerSpec(
        cfg.lr, cfg.weight_decay, cfg.grad_clip, cfg.warmup_steps, cfg.lr_schedule, total_steps
    )


class HybridWorker(Worker):
    """Args: the run's config, the resolved model directory, and ``cuda`` or ``cpu``."""

    def __init__(self, cfg: Config, model_path: str, device: str) -> None:
        super().__init__()
        self.cfg, self.device = cfg, device
        # Before the engines: vLLM adopts this process group as its world.
        self.init_process_group(device)
        torch.manual_seed(cfg.trainer.seed)
        self.actor = FSDPEngine(
            model_path,
            cfg.model,
            build_optimizer_spec(cfg.actor, count_optimizer_steps(cfg)),
            device,
        )
        self.ref = (
            FSDPEngine(model_path, cfg.model, None, device)
            if cfg.algorithm.uses_reference
            else None
        )
        self.policy_loss = POLICY_LOSSES.get(cfg.algorithm.policy_loss)
        self.packed = resolve_packing(cfg.actor.pack_sequences, device)
        self.rollout = self.build_rollout(model_path)
        self.weights_version = 0
        # Log-probs recorded during an on-policy update (see ``update``).
        self.own_logprobs: torch.Tensor | None = None
        # The engine starts awake with the checkpoint's weights: the first stage is rollout.
        self.mode = "rollout"
        self.rollout_weights_valid = True
        if cfg.actor.offload:
            self.actor.offload()

    def build_rollout(self, model_path: str) -> RolloutEngine:
        dtype = pick_dtype(self.cfg.model, self.device)
        if self.cfg.rollout.engine is RolloutEngineName.hf:
            from workers.engines.hf_rollout import HFRollout

            return HFRollout(
                model_path,
                self.device,
                dtype,
                self.cfg.model.trust_remote_code,
                self.cfg.rollout.sleep_level,
            )
        from workers.engines.vllm_rollout import VLLMRollout

        r = self.cfg.rollout
        max_len = self.cfg.data.max_prompt_length + compute_response_width(
            r.max_tokens, r.agent, self.cfg.agent
        )
        # Equal inside a tensor-parallel group (its ranks run one engine), different across them.
        seed = self.cfg.trainer.seed + self.rank // r.tensor_parallel_size
        return VLLMRollout(model_path, self.cfg.rollout, self.device, max_len, seed, dtype)

    # -- mode switch ---------------------------------------------------------------------
    #
    # Two modes: "rollout" (engine awake, FSDP state offloaded when actor.offload) and
    # "train" (engine asleep). ``rollout_weights_valid`` says whether waking the engine
    # restores usable weights: a level-2 sleep discards them, so the next wake must be
    # followed by a weight push. sync_weights always pushes; every other way into rollout
    # mode (a second DAPO sampling round, ReMax's greedy baseline, generation during critic
    # warm-up, validation) pushes only when the weights were discarded. The pushed weights
    # are the actor's, which on those paths equal the last synced ones.

    def enter_rollout_mode(self) -> None:
        if self.mode == "rollout":
            return
        if self.rollout_weights_valid:
            if self.cfg.actor.offload:
                self.actor.offload()
            self.rollout.wake_up()
        else:
            self.push_weights()
        self.mode = "rollout"

    def enter_train_mode(self) -> None:
        if self.mode == "train":
            return
        self.rollout.sleep()
        if self.rollout.discards_weights_on_sleep:
            self.rollout_weights_valid = False
        if self.cfg.actor.offload:
            self.actor.reload()
        self.mode = "train"

    def push_weights(self) -> None:
        """Stream the actor's weights into the sleeping engine and wake it fully.

        Order matters on a GPU: wake the engine's weights only, load them from the (still
        resident) FSDP shards, offload FSDP, and only then re-allocate the KV cache, so
        old weights, new weights and the KV cache never share the device at once. Every
        rank streams every full tensor in the same order (the gathers are collectives);
        with tensor parallelism each rank's vLLM loader keeps its own shard.
        """
        self.rollout.wake_up(tags=["weights"])
        bucket_bytes = self.cfg.rollout.weight_sync_bucket_mb * 2**20
        self.rollout.load_weights(self.actor.iter_full_weights(bucket_bytes))
        self.rollout_weights_valid = True
        if self.cfg.actor.offload:
            self.actor.offload()
        self.rollout.wake_up(tags=["kv_cache"])

    # -- stages --------------------------------------------------------------------------

    @dispatch(Dispatch.ROLLOUT_DP_SPLIT)
    def generate(self, prompts: Batch) -> Batch:
        """One sampled turn per row, in one engine call: ``response_ids``, ``response_mask``,
        ``loss_mask``, ``rollout_logprobs``. Every token of a turn was sampled, so the loss
        mask equals the response mask (a multi-turn agent adds observations on the driver).

        Optional inputs: a ``max_tokens`` tensor (each row's cap, e.g. what is left of a
        multi-turn budget); meta ``greedy`` (ReMax baselines), ``temperature`` (validation),
        ``more_turns`` (an episode goes on: leave the engine awake for the next turn).
        """
        self.enter_rollout_mode()
        rows = [
            ids[mask.bool()].tolist()
            for ids, mask in zip(prompts["prompt_ids"], prompts["prompt_mask"])
        ]
        per_row = tuple(int(m) for m in prompts["max_tokens"]) if "max_tokens" in prompts else None
        spec = SamplingSpec(
            max_tokens=self.cfg.rollout.max_tokens,
            # Greedy for baselines (ReMax); validation may set its own temperature.
            temperature=0.0
            if prompts.meta.get("greedy")
            else prompts.meta.get("temperature", self.cfg.rollout.temperature),
            top_p=self.cfg.rollout.top_p,
            stop_token_ids=tuple(prompts.meta["stop_token_ids"]),
            max_tokens_per_row=per_row,
        )
        samples = self.rollout.generate(rows, [int(s) for s in prompts["seed"]], spec)
        if not prompts.meta.get("more_turns"):
            self.enter_train_mode()
        width, pad = self.cfg.rollout.max_tokens, int(prompts.meta["pad_token_id"])
        ids = torch.full((len(samples), width), pad, dtype=torch.long)
        logprobs = torch.zeros(len(samples), width)
        mask = torch.zeros(len(samples), width)
        for i, s in enumerate(samples):
            n = len(s.response_ids)
            ids[i, :n] = torch.tensor(s.response_ids, dtype=torch.long)
            logprobs[i, :n] = torch.tensor(s.logprobs)
            mask[i, :n] = 1
        return Batch(
            {
                "response_ids": ids,
                "response_mask": mask,
                "loss_mask": mask.clone(),
                "rollout_logprobs": logprobs,
            },
            {"finish_reason": [s.finish_reason for s in samples]},
            {"weights_version": self.weights_version},
        )

    @dispatch(Dispatch.DP_SPLIT)
    def compute_logprobs(self, batch: Batch) -> Batch:
        """The current policy's log-probs of the response tokens (``old_logprobs``)."""
        return Batch({"old_logprobs": self.forward_logprobs(self.actor, batch)})

    @dispatch(Dispatch.DP_SPLIT)
    def compute_ref_logprobs(self, batch: Batch) -> Batch:
        """The frozen reference policy's log-probs of the response tokens."""
        if self.ref is None:
            raise RuntimeError(
                "compute_ref_logprobs needs a reference model: set algorithm.kl_coef or algorithm.kl_reward_coef > 0"
            )
        return Batch({"ref_logprobs": self.forward_logprobs(self.ref, batch)})

    @torch.no_grad()
    def forward_logprobs(self, engine: FSDPEngine, batch: Batch) -> torch.Tensor:
        """[B, R] log-probs of the loss-mask tokens (0 elsewhere), micro-batch by micro-batch."""
        self.enter_train_mode()
        engine.model.eval()
        a = self.cfg.actor
        out = torch.zeros(batch["response_ids"].shape)
        batch = batch.with_tensors(row_index=torch.arange(len(batch)))
        for micro in split_micro_batches(batch, a, self.device, self.packed):
            layout = build_layout(micro, self.packed)
            token = engine.compute_token_logprobs(
                layout, self.cfg.rollout.temperature, a.logprob_chunk_size, False
            )
            out[micro["row_index"]] = layout.to_grid(token.logprobs.cpu())
        return out

    @dispatch(Dispatch.DP_SPLIT)
    def update(self, batch: Batch) -> dict[str, float | torch.Tensor]:
        """PPO-style updates (epochs x mini-batches x micro-batches) on this rank's share.

        A batch without ``old_logprobs`` is an exactly on-policy step (one epoch, one
        mini-batch): the old log-probs are the update's own, detached, and come back as the
        ``old_logprobs`` entry ([rows, R], this rank's rows in order) beside the metrics.
        """
        self.enter_train_mode()
        on_policy = "old_logprobs" not in batch
        if on_policy:
            check_single_pass(len(batch), self.cfg.actor, self.world_size)
            batch = batch.with_tensors(row_index=torch.arange(len(batch)))
            self.own_logprobs = torch.zeros(batch["response_ids"].shape)
        metrics: dict[str, float | torch.Tensor] = dict(
            run_minibatch_updates(
                self.actor,
                batch,
                self.cfg.actor,
                self.world_size,
                forward_backward=self.forward_backward,
                prefix="actor",
                packed=self.packed,
            )
        )
        if on_policy:
            metrics["old_logprobs"], self.own_logprobs = self.own_logprobs, None
        return metrics

    def forward_backward(self, micro: Batch, scale: LossScale) -> dict[str, float]:
        cfg, a = self.cfg.algorithm, self.cfg.actor
        layout = build_layout(micro, self.packed)
        mask = micro["loss_mask"].to(self.device)
        token = self.actor.compute_token_logprobs(
            layout,
            self.cfg.rollout.temperature,
            a.logprob_chunk_size,
            with_entropy=True,
            entropy_grad=cfg.entropy_coef > 0,
        )
        logprobs = layout.to_grid(token.logprobs)
        old_logprobs = self.take_old_logprobs(micro, logprobs)
        out = self.policy_loss(
            PolicyLossInputs(
                logprobs=logprobs,
                old_logprobs=old_logprobs,
                advantages=micro["advantages"].to(self.device),
                loss_mask=mask,
                config=cfg,
            )
        )
        token_loss = out.token_loss
        if is_mismatch_correction_on(cfg):
            weights = compute_mismatch_weights(
                old_logprobs, micro["rollout_logprobs"].to(self.device), mask, cfg
            )
            token_loss = token_loss * weights
            out.metrics["mismatch_weight"] = weights
        loss = aggregate_loss(token_loss, mask, cfg.loss_agg, scale, cfg.loss_agg_norm)
        metrics = {"actor/pg_loss": float(masked_mean(token_loss.detach(), mask))}
        entropy = layout.to_grid(token.entropy)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * aggregate_loss(
                entropy, mask, cfg.loss_agg, scale, cfg.loss_agg_norm
            )
        metrics["actor/entropy"] = float(masked_mean(entropy.detach(), mask))
        if cfg.kl_coef > 0:
            kl = compute_kl(logprobs, micro["ref_logprobs"].to(self.device), cfg.kl_estimator)
            loss = loss + cfg.kl_coef * aggregate_loss(
                kl, mask, cfg.loss_agg, scale, cfg.loss_agg_norm
            )
            metrics["actor/kl"] = float(masked_mean(kl.detach(), mask))
        # FSDP averages gradients over ranks; the loss shares above sum to the mini-batch
        # loss over ranks, so scale by the world size to turn that average into the sum.
        (loss * self.world_size).backward()
        for name, value in out.metrics.items():
            metrics[f"actor/{name}"] = float(masked_mean(value, mask))
        return metrics

    def take_old_logprobs(self, micro: Batch, logprobs: torch.Tensor) -> torch.Tensor:
        """The batch's old log-probs, or, on an on-policy step, these log-probs detached
        (recorded for the driver)."""
        if "old_logprobs" in micro:
            return micro["old_logprobs"].to(self.device)
        own = logprobs.detach()
        self.own_logprobs[micro["row_index"]] = own.cpu()
        return own

    @dispatch(Dispatch.ONE_TO_ALL)
    def sync_weights(self) -> int:
        """Stream the trained weights into the rollout engine; returns the new version."""
        self.enter_train_mode()
        self.push_weights()
        self.mode = "rollout"
        self.weights_version += 1
        return self.weights_version

    @dispatch(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Write this rank's shards of the policy, its optimizer and LR schedule into ``path``.
        The reference model is not saved: it is the initial model, rebuilt at start."""
        self.enter_train_mode()
        save_engine(self.actor, path, {"weights_version": self.weights_version})

    @dispatch(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int:
        """Load the policy's state from ``path`` and push the weights into the rollout engine."""
        self.enter_train_mode()
        extra = load_engine(self.actor, path, {"weights_version": 0})
        self.sync_weights()
        self.weights_version = int(extra["weights_version"])
        return self.weights_version
