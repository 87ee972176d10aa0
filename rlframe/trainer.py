"""The training loop. ``Trainer.step()`` reads as the list of a step's stages:
generate -> reward -> log-probs -> advantage -> update -> weight sync, one call each.

The driver owns the loop, the data and the rewards; everything on a device is one call on
the actor worker group (see ``workers/hybrid.py``).
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlframe.algorithms.advantages import ADVANTAGES, AdvantageInputs, place_on_last_token
from rlframe.algorithms.losses import KLController, apply_kl_penalty
from rlframe.algorithms.mismatch import compute_mismatch_metrics
from rlframe.algorithms.registry import load_class
from rlframe.checkpoint import Checkpointer, read_driver_state, truncate_run_logs, write_hf_config
from rlframe.config import Config, RewardConfig
from rlframe.controller.cluster import init_ray, resolve_device
from rlframe.data.loader import PromptLoader
from rlframe.logs import describe_run, format_startup_summary, route_driver_logs
from rlframe.preflight import RunInputs
from rlframe.protocol import Batch
from rlframe.rewards import RuleScorer
from rlframe.rollout import ExperienceProducer
from rlframe.rollout.sampling import split_uniform_groups  # noqa: F401  (its old home; tests import it here)
from rlframe.sequence_layout import balance_ranks, count_row_tokens
from rlframe.tracking import StageTimer, Tracker
from rlframe.validation import Validator


class Trainer:
    """Drives the actor group (hybrid actor/rollout/reference workers) and, for PPO, the critic."""

    def __init__(
        self,
        cfg: Config,
        actor: Any,
        critic: Any | None,
        tokenizer: Any,
        loader: PromptLoader,
        tracker: Tracker,
        checkpointer: Checkpointer | None = None,
        validator: Validator | None = None,
        reward_model: Any | None = None,
    ) -> None:
        self.cfg, self.actor, self.critic = cfg, actor, critic
        self.tokenizer, self.loader, self.tracker = tokenizer, loader, tracker
        self.advantage_fn = ADVANTAGES.get(cfg.algorithm.advantage)
        self.reward_name = resolve_reward_name(cfg)
        self.rule_scorer = (
            RuleScorer(self.reward_name, cfg.reward) if cfg.reward.uses_rule else None
        )
        self.reward_model = reward_model
        # The reward model scores on its workers while the driver runs the rule reward.
        self.reward_model_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="reward-model")
            if reward_model is not None
            else None
        )
        self.use_ref = cfg.algorithm.uses_reference
        self.experience = ExperienceProducer(
            cfg, actor.generate, tokenizer, loader, self.compute_rewards
        )
        a = cfg.algorithm
        self.kl_ctrl = KLController(a.kl_reward_coef, a.kl_reward_ctrl, a.kl_target, a.kl_horizon)
        self.step_count = 0
        self.checkpointer, self.validator = checkpointer, validator

    def fit(self) -> list[dict[str, float]]:
        """Steps from the current one (0, or a resumed checkpoint's) to ``trainer.total_steps``;
        validation and checkpoints after the steps that are due."""
        t = self.cfg.trainer
        history = []
        if self.validator is not None and t.val_before_train and self.step_count == 0:
            self.tracker.log(0, self.validator.run(self.experience.generate, self.experience.score))
        while self.step_count < t.total_steps:
            self.step_count += 1
            metrics = self.step()
            if self.validator is not None and self.is_due(t.val_every):
                metrics |= self.validator.run(self.experience.generate, self.experience.score)
            self.tracker.log(self.step_count, metrics)
            history.append(metrics)
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
            "groups_served": self.experience.groups_served,
            "seed": self.cfg.trainer.seed,
            "loader": self.loader.state_dict(),
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "tracker": self.tracker.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count, self.experience.groups_served = (
            int(state["step"]),
            int(state["groups_served"]),
        )
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.tracker.load_state_dict(state["tracker"])

    def step(self) -> dict[str, float]:
        timer = StageTimer()
        metrics: dict[str, float] = {}
        with timer("step"):
            # gen, reward (and baseline): prompts -> scored responses, by the configured agent.
            batch = self.experience.next_batch(timer, metrics)
            if self.needs_old_logprob_pass():
                with timer("old_logprob"):
                    batch = batch.union(self.actor.compute_logprobs(batch))
            if self.use_ref:
                with timer("ref"):
                    batch = batch.union(self.actor.compute_ref_logprobs(batch))
            if self.critic is not None:
                with timer("values"):
                    batch = batch.union(self.critic.compute_values(batch))
            with timer("adv"):
                batch = self.compute_advantages(batch, metrics)
            if self.critic is not None:
                with timer("update_critic"):
                    metrics |= average(self.critic.update(batch.rows(self.order_for_ranks(batch))))
            if self.step_count > self.cfg.critic.warmup_steps or self.critic is None:
                with timer("update"):
                    batch = self.update_actor(batch, metrics)
                with timer("sync"):
                    self.actor.sync_weights()
        self.log_rollouts(batch)
        metrics |= compute_mismatch_metrics(
            batch["old_logprobs"], batch["rollout_logprobs"], batch["loss_mask"], self.cfg.algorithm
        )
        return metrics | collect_step_metrics(batch, timer)

    def needs_old_logprob_pass(self) -> bool:
        """Old log-probs need their own forward pass unless the update is exactly on-policy:
        one epoch of one mini-batch starts from the weights that the old log-probs are
        taken with, so the update's own log-probs (detached) are the same numbers. The
        in-reward KL reads them before the update, and without an actor update this step
        (critic warm-up) nothing would compute them."""
        a, actor = self.cfg.algorithm, self.cfg.actor
        one_pass = (
            actor.epochs == 1
            and actor.mini_batch_size == self.cfg.data.batch_size * self.cfg.rollout.n
        )
        actor_updates = self.critic is None or self.step_count > self.cfg.critic.warmup_steps
        return (
            a.recompute_old_logprobs or not one_pass or self.kl_ctrl.value > 0 or not actor_updates
        )

    def order_for_ranks(self, batch: Batch) -> torch.Tensor:
        """A row order giving each data-parallel rank about the same tokens of every
        mini-batch (see :func:`rlframe.sequence_layout.balance_ranks`), counted in real
        tokens whether or not the workers pack them."""
        world = self.cfg.trainer.world_size
        if world == 1:
            return torch.arange(len(batch))
        costs = count_row_tokens(batch, packed=True)
        return balance_ranks(costs, world, self.cfg.actor.mini_batch_size)

    def update_actor(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        """One policy update on rank-balanced rows (its metrics go into ``metrics``). After
        an on-policy update without an old-log-prob pass, the update's own log-probs come
        back and become ``old_logprobs``."""
        order = self.order_for_ranks(batch)
        per_rank = self.actor.update(batch.rows(order))
        own = [m.pop("old_logprobs") for m in per_rank if "old_logprobs" in m]
        metrics |= average(per_rank)
        if "old_logprobs" in batch:
            return batch
        old = torch.empty(batch["response_mask"].shape)
        old[order] = torch.cat(own)
        return batch.with_tensors(old_logprobs=old)

    def compute_rewards(self, batch: Batch) -> Batch:
        """Add ``score`` (``reward.weight`` x the rule reward + ``reward.model.weight`` x the
        reward model's score), ``reward`` (score + overlong shaping) and the decoded ``response``.

        Also per row: ``rule_score``, ``reward_errors`` and ``reward_timeouts`` (1 where the
        rule reward failed and scored 0 under ``reward.on_error=zero``) and ``rm_score``.
        """
        r = self.cfg.reward
        texts = [
            self.decode(ids, mask)
            for ids, mask in zip(batch["response_ids"], batch["response_mask"])
        ]
        pending_rm = self.start_reward_model(batch, texts)
        score = torch.zeros(len(batch))
        parts: dict[str, torch.Tensor] = {}
        if self.rule_scorer is not None:
            samples = [{"prompt": p, **extra} for p, extra in zip(batch["prompt"], batch["extra"])]
            rule = self.rule_scorer.score(texts, list(batch["ground_truth"]), samples)
            parts |= {
                "rule_score": torch.tensor(rule.scores),
                "reward_errors": torch.tensor(rule.errors, dtype=torch.float32),
                "reward_timeouts": torch.tensor(rule.timeouts, dtype=torch.float32),
            }
            score += r.weight * parts["rule_score"]
        if pending_rm is not None:
            parts["rm_score"] = pending_rm.result()
            score += r.model.weight * parts["rm_score"]
        # Sampled tokens against their budget: observations in a multi-turn response do not count.
        penalty = compute_overlong_penalty(
            batch["loss_mask"].sum(1), self.cfg.rollout.max_tokens, r
        )
        return Batch(
            batch.tensors | parts | {"score": score, "reward": score + penalty},
            batch.columns | {"response": texts},
            batch.meta,
        )

    def start_reward_model(self, batch: Batch, texts: list[str]) -> Future[torch.Tensor] | None:
        """Send prompts (as chat turns) and responses to the reward-model group, in the background."""
        if self.reward_model is None or self.reward_model_thread is None:
            return None
        if "messages" in batch:
            messages = batch["messages"]
        else:
            messages = [[{"role": "user", "content": p}] for p in batch["prompt"]]
        request = Batch(columns={"messages": as_object_column(messages), "response": texts})
        return self.reward_model_thread.submit(
            lambda: self.reward_model.compute_rm_scores(request)["rm_score"]
        )

    def close(self) -> None:
        """Stop the reward processes and the reward-model thread."""
        if self.rule_scorer is not None:
            self.rule_scorer.close()
        if self.reward_model_thread is not None:
            self.reward_model_thread.shutdown(wait=False, cancel_futures=True)

    def decode(self, ids: torch.Tensor, mask: torch.Tensor) -> str:
        """The response text without its closing EOS. Other special tokens stay visible, so
        a policy cannot hide junk from the reward behind tokens that decode to nothing."""
        tokens = ids[mask.bool()].tolist()
        if tokens and tokens[-1] == self.tokenizer.eos_token_id:
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def compute_advantages(self, batch: Batch, metrics: dict[str, float]) -> Batch:
        mask = batch["loss_mask"]
        token_rewards = place_on_last_token(batch["reward"], mask)
        if self.kl_ctrl.value > 0:
            token_rewards, kl = apply_kl_penalty(
                token_rewards,
                batch["old_logprobs"],
                batch["ref_logprobs"],
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
                group_index=batch["group"],
                config=self.cfg.algorithm,
                token_rewards=token_rewards,
                values=batch.tensors.get("values"),
                baseline=batch.tensors.get("baseline"),
            )
        )
        metrics |= {f"adv/{k}": v for k, v in out.metrics.items()}
        return batch.with_tensors(advantages=out.advantages, returns=out.returns)

    def log_rollouts(self, batch: Batch) -> None:
        keep = min(self.cfg.trainer.rollouts_to_log, len(batch))
        rows = [
            {
                "prompt": batch["prompt"][i],
                "response": batch["response"][i],
                "ground_truth": batch["ground_truth"][i],
                "reward": float(batch["reward"][i]),
                "finish_reason": batch["finish_reason"][i],
            }
            for i in range(keep)
        ]
        self.tracker.log_rollouts(self.step_count, rows)


def compute_overlong_penalty(
    lengths: torch.Tensor, max_tokens: int, cfg: RewardConfig
) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to max_tokens - buffer, then falling linearly to
    -penalty at max_tokens."""
    if cfg.overlong_buffer <= 0:
        return torch.zeros(lengths.shape)
    excess = (lengths.float() - (max_tokens - cfg.overlong_buffer)).clamp(min=0)
    return -cfg.overlong_penalty * (excess / cfg.overlong_buffer).clamp(max=1)


def as_object_column(values: Any) -> np.ndarray:
    """A column of python objects (lists of chat turns) filled one row at a time."""
    column = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        column[i] = value
    return column


def average(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each metric over the ranks."""
    return {k: sum(m[k] for m in per_rank) / len(per_rank) for k in per_rank[0]}


def resolve_reward_name(cfg: Config) -> str:
    """``auto``: partial-credit char_match for the synthetic tasks, exact_match for files."""
    if cfg.reward.fn != "auto":
        return cfg.reward.fn
    return "exact_match" if cfg.data.train_files else "char_match"


def collect_step_metrics(batch: Batch, timer: StageTimer) -> dict[str, float]:
    """The step's metrics: rewards, lengths, rollout/trainer agreement, timings."""
    mask = batch["loss_mask"]
    # Sampled tokens only: tool observations in a multi-turn response are not the policy's.
    lengths = mask.sum(1)
    rewards = batch["reward"]
    # Same tokens, same weights: any gap is numerics or a stale weight sync.
    diff = (
        (batch["rollout_logprobs"] - batch["old_logprobs"]).abs() * mask
    ).sum() / mask.sum().clamp(min=1)
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/max": float(rewards.max()),
        "reward/min": float(rewards.min()),
        "reward/score_mean": float(batch["score"].mean()),
        "response_length/mean": float(lengths.float().mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(
            sum(r == "length" for r in batch["finish_reason"]) / len(batch)
        ),
        "rollout/logprob_diff": float(diff),
        "rollout/weights_version": float(batch.meta.get("weights_version", 0)),
    }
    metrics |= collect_reward_metrics(batch)
    metrics |= timer.metrics()
    tokens = float(batch["response_mask"].sum() + batch["prompt_mask"].sum())
    metrics["perf/tokens_per_s"] = tokens / metrics["timing_s/step"]
    return metrics


def collect_reward_metrics(batch: Batch) -> dict[str, float]:
    """Failed rule-reward samples (counts) and the means of the reward's parts, when present."""
    metrics = {}
    for key, name in (("reward_errors", "reward/errors"), ("reward_timeouts", "reward/timeouts")):
        if key in batch.tensors:
            metrics[name] = float(batch[key].sum())
    for key, name in (("rule_score", "reward/rule_mean"), ("rm_score", "reward/model_mean")):
        if key in batch.tensors:
            metrics[name] = float(batch[key].float().mean())
    return metrics


def prepare_output_dir(cfg: Config, resume_step: int | None) -> Path:
    """Create the run directory and write the resolved config into it. Nothing is deleted: a
    resumed run writes ``config.resume_<step>.json`` and drops only the log lines after its
    checkpoint (see :func:`rlframe.checkpoint.resolve_resume` for a directory in use)."""
    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "config.json" if resume_step is None else f"config.resume_{resume_step}.json"
    (out / name).write_text(json.dumps(asdict(cfg), indent=2, default=str))
    if resume_step is not None:
        truncate_run_logs(out, resume_step)
    return out


def worker_env(cfg: Config, device: str) -> dict[str, str]:
    """Environment every worker process starts with (read by torch and vLLM at import)."""
    env = {"TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if device == "cpu":
        env |= {
            "OMP_NUM_THREADS": str(cfg.trainer.cpus_per_proc),
            "VLLM_CPU_KVCACHE_SPACE": str(cfg.rollout.cpu_kv_cache_gb),
        }
    else:
        env |= {"NCCL_CUMEM_ENABLE": "0"}
    return env


def run_training(cfg: Config, inputs: RunInputs) -> list[dict[str, float]]:
    """Start or join Ray, place the workers, train, and tear everything down.

    ``inputs`` come from :func:`rlframe.preflight.check_run_inputs`, run before Ray starts.
    Returns the metrics of every step (also written to ``metrics.jsonl``).
    """
    model_path, tokenizer, resume_from = inputs.model_path, inputs.tokenizer, inputs.resume_from
    records, val_records = inputs.records, inputs.val_records
    out = prepare_output_dir(
        cfg, None if resume_from is None else read_driver_state(resume_from)["step"]
    )
    logs = route_driver_logs(out, cfg.trainer.log_level)
    started = False
    pool, tracker, trainer, groups = None, None, None, []
    try:
        started = init_ray(cfg.ray)
        import ray

        from rlframe.controller.placement import ResourcePool
        from rlframe.controller.worker_group import WorkerGroup

        device = resolve_device(cfg.trainer.device)
        print(
            format_startup_summary(describe_run(cfg, model_path, device, out, logs, started)),
            flush=True,
        )
        # The critic and the reward model, when there are, share the actor's bundles.
        pool = ResourcePool(
            nnodes=cfg.trainer.nnodes,
            procs_per_node=cfg.trainer.procs_per_node,
            device=device,
            cpus_per_proc=cfg.trainer.cpus_per_proc,
            max_colocate=1 + int(bool(cfg.critic.enable)) + int(cfg.reward.uses_model),
            name="actor_rollout",
        )
        pool.create(timeout_s=cfg.ray.placement_timeout_s)

        def start(role: str, worker_cls: str, path: str = model_path) -> WorkerGroup:
            group = WorkerGroup(
                pool,
                load_class(worker_cls),
                role=role,
                init_args=(cfg, path, device),
                call_timeout_s=cfg.ray.call_timeout_s,
                env=worker_env(cfg, device) | logs.worker_env(),
                rollout_tp_size=cfg.rollout.tensor_parallel_size,
            )
            groups.append(group)
            return group

        actor = start("actor", cfg.actor.worker_cls)
        critic = start("critic", cfg.critic.worker_cls) if cfg.critic.enable else None
        reward_model = None
        if inputs.reward_model_path is not None:
            reward_model = start(
                "reward_model", cfg.reward.model.worker_cls, inputs.reward_model_path
            )
        tracker = Tracker(
            out,
            cfg.trainer.loggers,
            cfg.trainer.total_steps,
            cfg,
            cfg.trainer.project,
            cfg.trainer.experiment,
        )
        loader = PromptLoader(records, cfg.data.batch_size, cfg.trainer.seed)
        checkpointer = Checkpointer(
            out,
            cfg.trainer.keep_last,
            {"actor": actor} | ({"critic": critic} if critic is not None else {}),
            lambda dest: write_hf_config(model_path, tokenizer, dest, cfg.model.trust_remote_code),
            cfg.trainer.export_hf,
        )
        validator = Validator(val_records, cfg, tokenizer) if val_records else None
        trainer = Trainer(
            cfg, actor, critic, tokenizer, loader, tracker, checkpointer, validator, reward_model
        )
        if resume_from is not None:
            trainer.load_state_dict(checkpointer.load(resume_from))
            print(f"rlframe: resumed from {resume_from} at step {trainer.step_count}", flush=True)
        return trainer.fit()
    finally:
        if trainer is not None:
            trainer.close()
        if tracker is not None:
            tracker.close()
        for group in groups:
            group.shutdown()
        if pool is not None:
            pool.remove()
        if started:
            ray.shutdown()
        logs.close()
