"""The training loop. ``Trainer.step()`` reads as the list of a step's stages:
experience (generate, reward) -> log-probs -> advantage -> update -> weight sync.

The driver owns the loop. Experience (prompts, agents, rewards, baselines) comes from the
:class:`~rlframe.rollout.ExperienceProducer`, one call a step; everything on a device is one
call on a worker group (the actor's, the critic's), and the weights cross to the rollout
engines through the
``sync_weights`` callable the launcher (:mod:`rlframe.run.launch`) builds for the placement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlframe.algorithms.advantages import ADVANTAGES, AdvantageInputs, place_on_last_token
from rlframe.algorithms.losses import KLController, apply_kl_penalty
from rlframe.algorithms.mismatch import compute_mismatch_metrics
from rlframe.algorithms.off_policy import (
    OldLogprobs,
    compute_off_policy_metrics,
    pick_old_logprobs,
    plan_old_logprobs,
)
from rlframe.config import Config
from rlframe.controller.roles import ActorGroup, CriticGroup
from rlframe.core.protocol import Batch, read_sample_mask
from rlframe.core.sequence_layout import balance_rows
from rlframe.loop.distillation import Distillation
from rlframe.loop.step_metrics import collect_step_metrics
from rlframe.loop.sync_check import SyncCheck
from rlframe.loop.validation import Validator
from rlframe.observability.tracking import StageTimer, Tracker
from rlframe.rollout import Producer
from rlframe.state.checkpoint import Checkpointer


class Trainer:
    """Drives the actor group (training and reference) and, for PPO, the critic.

    Args:
        cfg: the run's config.
        actor: the actor worker group (``compute_logprobs``, ``compute_ref_logprobs``, ``update``).
        critic: the critic worker group, or None.
        experience: produces each step's scored Batch.
        sync_weights: moves the trained weights to the rollout engines; returns the new
            weights version.
        tracker: metrics and rollout logs.
        checkpointer: saves the run when due (None: never).
        validator: validation when due (None: never).
        sync_check: the run's sync check (None: off; see
            :class:`rlframe.loop.sync_check.SyncCheck`).
        read_sync_check: each rollout rank's receiver check of the last sync (dicts, None
            where none ran), read after every sync.
        distillation: the teachers' stage, check and objective (None: no distillation).
    """

    def __init__(
        self,
        cfg: Config,
        actor: ActorGroup,
        critic: CriticGroup | None,
        experience: Producer,
        sync_weights: Callable[[], int],
        tracker: Tracker,
        checkpointer: Checkpointer | None = None,
        validator: Validator | None = None,
        sync_check: SyncCheck | None = None,
        read_sync_check: Callable[[], list[dict[str, Any] | None]] | None = None,
        distillation: Distillation | None = None,
    ) -> None:
        self.cfg, self.actor, self.critic = cfg, actor, critic
        self.experience, self.sync_weights, self.tracker = experience, sync_weights, tracker
        self.advantage_fn = ADVANTAGES.get(cfg.algorithm.advantage)
        self.use_ref = cfg.algorithm.uses_reference
        a = cfg.algorithm
        self.kl_ctrl = KLController(a.kl_reward_coef, a.kl_reward_ctrl, a.kl_target, a.kl_horizon)
        self.step_count = 0
        self.weights_version = 0
        """The version of the trainer's weights (the last sync's): what it scores batches with."""
        self.checkpointer, self.validator = checkpointer, validator
        self.sync_check = sync_check or SyncCheck(None)
        self.read_sync_check = read_sync_check
        self.scored_with = 0
        """The weights version the step's fresh tokens were scored with."""
        self.probes: list[dict[str, Any] | None] = []
        """The receiver checks of the step's sync."""
        self.distillation = distillation

    def fit(self) -> list[dict[str, float]]:
        """Steps from the current one (0, or a resumed checkpoint's) to ``trainer.total_steps``;
        validation and checkpoints after the steps that are due. A step whose rollout/trainer
        gap fails the sync check is logged, not saved, and raises
        :class:`~rlframe.loop.sync_check.BrokenSyncError`."""
        t = self.cfg.trainer
        history = []
        if self.validator is not None and t.val_before_train and self.step_count == 0:
            self.tracker.log(0, self.validator.run())
        while self.step_count < t.total_steps:
            self.step_count += 1
            self.probes = []
            metrics = self.step()
            broken = self.sync_check.judge(self.step_count, metrics, self.scored_with, self.probes)
            if broken is None and self.distillation is not None:
                broken = self.distillation.take_broken()
            if self.validator is not None and self.is_due(t.val_every):
                metrics |= self.validator.run()
            self.tracker.log(self.step_count, metrics)
            history.append(metrics)
            if broken is not None:
                raise broken
            if self.checkpointer is not None and self.is_due(t.save_every):
                self.checkpointer.save(self.step_count, self.state_dict())
        return history

    def is_due(self, every: int) -> bool:
        """Every ``every`` steps and after the last one; never when ``every`` is 0."""
        return every > 0 and (
            self.step_count % every == 0 or self.step_count == self.cfg.trainer.total_steps
        )

    def state_dict(self) -> dict[str, Any]:
        """The driver's part of a checkpoint (JSON-serialisable)."""
        return {
            "step": self.step_count,
            "seed": self.cfg.trainer.seed,
            "experience": self.experience.state_dict(),
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "tracker": self.tracker.state_dict(),
            "weights_version": self.weights_version,
            "sync_check_honest": self.sync_check.honest,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step"])
        self.weights_version = int(state.get("weights_version", 0))
        # The honest gap measured at version 0; a resumed run has no version-0 tokens left.
        self.sync_check.honest = state.get("sync_check_honest")
        self.experience.load_state_dict(state["experience"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.tracker.load_state_dict(state["tracker"])

    def step(self) -> dict[str, float]:
        timer = StageTimer()
        with timer("step"):
            # gen, reward (and baseline): prompts -> rewarded responses, by the configured agent.
            batch, metrics = self.experience.next_batch()
            scored_with = self.scored_with = self.weights_version
            if self.distillation is not None:
                with timer("teacher"):
                    batch, distilled = self.distillation.attach(batch, self.step_count)
                metrics |= distilled
            batch = self.attach_old_logprobs(batch, timer)
            if self.use_ref:
                with timer("ref"):
                    batch = batch.union(self.actor.compute_ref_logprobs(batch))
            if self.critic is not None:
                with timer("values"):
                    batch = batch.union(self.critic.compute_values(batch))
            with timer("adv"):
                batch, adv_metrics = self.compute_advantages(batch)
            if self.critic is not None:
                with timer("update_critic"):
                    metrics |= self.update_critic(self.critic, batch)
            if self.actor_updates():
                with timer("update"):
                    batch, actor_metrics = self.update_actor(batch)
                with timer("sync"):
                    self.weights_version = self.sync_weights()
                    if self.read_sync_check is not None:
                        self.probes = self.read_sync_check()
                metrics |= actor_metrics
        self.log_rollouts(batch)
        metrics |= adv_metrics | self.collect_correction_metrics(batch)
        # Lockstep scores every token with the weights that sampled it; asynchronous steps
        # split the rollout/trainer gap by the tokens' versions.
        version = scored_with if self.cfg.rollout.max_staleness > 0 else None
        return metrics | collect_step_metrics(batch, timer, self.has_trainer_logprobs, version)

    def actor_updates(self) -> bool:
        """The actor updates (and syncs) every step, except while a critic learns alone
        (``critic.actor_wait_steps``)."""
        return self.critic is None or self.step_count > self.cfg.critic.actor_wait_steps

    @property
    def has_trainer_logprobs(self) -> bool:
        """The batch's old log-probs are the trainer's; with the rollout's as the old policy
        there is nothing to compare the rollout with (no ``rollout/logprob_diff``, no
        ``mismatch/*``)."""
        # The trainer's whether its pass ran or the update gave them.
        correction = self.cfg.algorithm.off_policy_correction
        return pick_old_logprobs(correction, recomputed=True) is not OldLogprobs.rollout

    def collect_correction_metrics(self, batch: Batch) -> dict[str, float]:
        """``mismatch/*`` (trainer vs rollout) and ``off_policy/behav_weight_*`` (decoupled)."""
        if not self.has_trainer_logprobs:
            return {}
        args = (
            batch.tensor("old_logprobs"),
            batch.tensor("rollout_logprobs"),
            batch.tensor("loss_mask"),
        )
        return compute_mismatch_metrics(*args, self.cfg.algorithm) | compute_off_policy_metrics(
            *args, self.cfg.algorithm
        )

    def attach_old_logprobs(self, batch: Batch, timer: StageTimer) -> Batch:
        """The old policy's log-probs (:meth:`plan_old_logprobs`): the rollout's own, the
        trainer's forward pass (timed as ``old_logprob``), or none yet when the update is
        exactly on-policy and returns its own."""
        source = self.plan_old_logprobs(len(batch))
        if source is OldLogprobs.rollout:
            return batch.with_tensors(old_logprobs=batch.tensor("rollout_logprobs"))
        if source is OldLogprobs.update:
            return batch
        with timer("old_logprob"):
            return batch.union(self.actor.compute_logprobs(batch))

    def plan_old_logprobs(self, rows: int) -> OldLogprobs:
        """See :func:`rlframe.algorithms.off_policy.plan_old_logprobs`."""
        # rows: the batch's own, which an agent that forks rows (rollout.agent=openai) makes
        # more than data.batch_size * rollout.n.
        return plan_old_logprobs(
            self.cfg, rows, kl_in_reward=self.kl_ctrl.value > 0, actor_updates=self.actor_updates()
        )

    def needs_old_logprob_pass(self, rows: int) -> bool:
        """The step runs the trainer's old-log-prob pass (:meth:`plan_old_logprobs`)."""
        return self.plan_old_logprobs(rows) is OldLogprobs.recomputed

    def update_critic(self, critic: CriticGroup, batch: Batch) -> dict[str, float]:
        """One value update on rank-balanced rows; its metrics averaged over the ranks."""
        order = balance_rows(batch, self.cfg.trainer.world_size, self.cfg.actor.mini_batch_size)
        return average(critic.update(batch.rows(order)))

    def update_actor(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """One policy update on rank-balanced rows, and its metrics. After an on-policy
        update without an old-log-prob pass, the update's own log-probs come back and
        become ``old_logprobs``."""
        order = balance_rows(batch, self.cfg.trainer.world_size, self.cfg.actor.mini_batch_size)
        per_rank = self.actor.update(batch.rows(order))
        metrics = average([r.metrics for r in per_rank])
        own = [r.own_logprobs for r in per_rank if r.own_logprobs is not None]
        if "old_logprobs" in batch:
            return batch, metrics
        old = torch.empty(batch.tensor("response_mask").shape)
        old[order] = torch.cat(own)
        return batch.with_tensors(old_logprobs=old), metrics

    def compute_advantages(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """Token rewards (minus the in-reward KL penalty, which feeds its controller), then
        the configured estimator's advantages and returns; the ``adv/*`` and KL metrics."""
        mask = batch.tensor("loss_mask")
        metrics: dict[str, float] = {}
        token_rewards = place_on_last_token(batch.tensor("reward"), mask)
        if self.kl_ctrl.value > 0:
            token_rewards, kl = apply_kl_penalty(
                token_rewards,
                batch.tensor("old_logprobs"),
                batch.tensor("ref_logprobs"),
                mask,
                self.kl_ctrl.value,
                self.cfg.algorithm.kl_reward_estimator,
            )
            metrics |= {"actor/reward_kl": kl, "actor/kl_reward_coef": self.kl_ctrl.value}
            self.kl_ctrl.update(kl, len(batch))
        out = self.advantage_fn(
            AdvantageInputs(
                rewards=token_rewards.sum(-1),
                loss_mask=mask,
                group_index=batch.tensor("group"),
                config=self.cfg.algorithm,
                token_rewards=token_rewards,
                values=batch.tensors.get("values"),
                baseline=batch.tensors.get("baseline"),
                sample_mask=read_sample_mask(batch),
            )
        )
        metrics |= {f"adv/{k}": v for k, v in out.metrics.items()}
        advantages = out.advantages
        if self.distillation is not None:
            advantages = self.distillation.shape_advantages(advantages, batch)
        return batch.with_tensors(advantages=advantages, returns=out.returns), metrics

    def log_rollouts(self, batch: Batch) -> None:
        keep = min(self.cfg.trainer.rollouts_to_log, len(batch))
        counted = read_sample_mask(batch)
        rows = [
            {
                "prompt": batch.column("prompt")[i],
                "response": batch.column("response")[i],
                "ground_truth": batch.column("ground_truth")[i],
                "reward": float(batch.tensor("reward")[i]),
                "finish_reason": batch.column("finish_reason")[i],
                # Its reward or env failed under on_error=mask: the reward 0 is no score.
                "masked": not bool(counted[i]),
            }
            for i in range(keep)
        ]
        self.tracker.log_rollouts(self.step_count, rows)


def average(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each metric over the ranks."""
    return {k: sum(m[k] for m in per_rank) / len(per_rank) for k in per_rank[0]}
