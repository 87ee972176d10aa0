"""The training loop. ``Trainer.step()`` reads as the list of a step's stages:
generate -> reward -> log-probs -> advantage -> update -> weight sync, one call each.

The driver owns the loop, the data and the rewards; everything on a device is one call on
the actor worker group (see ``workers/hybrid.py``).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from rlframe.algorithms.advantages import ADVANTAGES, AdvantageInputs
from rlframe.config import Config
from rlframe.controller.cluster import init_ray, resolve_device
from rlframe.data.loader import PromptLoader, build_prompt_batch
from rlframe.protocol import Batch
from rlframe.rewards import REWARDS, compute_rewards
from rlframe.tracking import StageTimer, Tracker


class Trainer:
    """Drives one worker group of hybrid actor/rollout/reference workers."""

    def __init__(self, cfg: Config, actor: Any, tokenizer: Any, loader: PromptLoader, tracker: Tracker) -> None:
        self.cfg, self.actor, self.tokenizer, self.loader, self.tracker = cfg, actor, tokenizer, loader, tracker
        self.advantage_fn = ADVANTAGES.get(cfg.algorithm.advantage)
        self.reward_name = resolve_reward_name(cfg)
        self.reward_fn = REWARDS.get(self.reward_name)
        self.use_ref = cfg.algorithm.kl_coef > 0
        self.step_count = 0

    def fit(self) -> list[dict[str, float]]:
        history = []
        for _ in range(self.cfg.trainer.total_steps):
            self.step_count += 1
            metrics = self.step()
            self.tracker.log(self.step_count, metrics)
            history.append(metrics)
        return history

    def step(self) -> dict[str, float]:
        timer = StageTimer()
        with timer("step"):
            prompts = self.next_prompts()
            with timer("gen"):
                batch = prompts.union(self.actor.generate(prompts))
            with timer("reward"):
                batch = self.compute_rewards(batch)
            with timer("old_logprob"):
                batch = batch.union(self.actor.compute_logprobs(batch))
            if self.use_ref:
                with timer("ref"):
                    batch = batch.union(self.actor.compute_ref_logprobs(batch))
            with timer("adv"):
                batch = self.compute_advantages(batch)
            with timer("update"):
                update_metrics = self.actor.update(batch)
            with timer("sync"):
                self.actor.sync_weights()
        self.log_rollouts(batch)
        return collect_step_metrics(batch, update_metrics, timer)

    def next_prompts(self) -> Batch:
        records = self.loader.next_records()
        first_group = (self.step_count - 1) * self.cfg.data.batch_size
        batch = build_prompt_batch(
            records, self.cfg.rollout.n, first_group, self.tokenizer.pad_token_id, self.cfg.trainer.seed
        )
        batch.meta |= {"stop_token_ids": [self.tokenizer.eos_token_id], "pad_token_id": self.tokenizer.pad_token_id}
        return batch

    def compute_rewards(self, batch: Batch) -> Batch:
        texts = [self.decode(ids, mask) for ids, mask in zip(batch["response_ids"], batch["response_mask"])]
        samples = [{"prompt": p, **extra} for p, extra in zip(batch["prompt"], batch["extra"])]
        scores = compute_rewards(self.reward_fn, self.reward_name, texts, list(batch["ground_truth"]), samples)
        return Batch(
            batch.tensors | {"reward": torch.tensor(scores, dtype=torch.float32)},
            batch.columns | {"response": texts},
            batch.meta,
        )

    def decode(self, ids: torch.Tensor, mask: torch.Tensor) -> str:
        """The response text without its closing EOS. Other special tokens stay visible, so
        a policy cannot hide junk from the reward behind tokens that decode to nothing."""
        tokens = ids[mask.bool()].tolist()
        if tokens and tokens[-1] == self.tokenizer.eos_token_id:
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def compute_advantages(self, batch: Batch) -> Batch:
        out = self.advantage_fn(
            AdvantageInputs(batch["reward"], batch["response_mask"], batch["group"], self.cfg.algorithm)
        )
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


def resolve_reward_name(cfg: Config) -> str:
    """``auto``: partial-credit char_match for the synthetic tasks, exact_match for files."""
    if cfg.reward.fn != "auto":
        return cfg.reward.fn
    return "exact_match" if cfg.data.train_files else "char_match"


def collect_step_metrics(batch: Batch, update_metrics: list[dict[str, float]], timer: StageTimer) -> dict[str, float]:
    """The step's metrics: rewards, lengths, rollout/trainer agreement, update, timings."""
    mask = batch["response_mask"]
    lengths = mask.sum(1)
    rewards = batch["reward"]
    # Same tokens, same weights: any gap is numerics or a stale weight sync.
    diff = ((batch["rollout_logprobs"] - batch["old_logprobs"]).abs() * mask).sum() / mask.sum().clamp(min=1)
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/max": float(rewards.max()),
        "reward/min": float(rewards.min()),
        "response_length/mean": float(lengths.float().mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(sum(r == "length" for r in batch["finish_reason"]) / len(batch)),
        "rollout/logprob_diff": float(diff),
        "rollout/weights_version": float(batch.meta.get("weights_version", 0)),
    }
    for key in update_metrics[0]:
        metrics[key] = sum(m[key] for m in update_metrics) / len(update_metrics)
    metrics |= timer.metrics()
    tokens = float(mask.sum() + batch["prompt_mask"].sum())
    metrics["perf/tokens_per_s"] = tokens / metrics["timing_s/step"]
    return metrics


def prepare_output_dir(cfg: Config) -> Path:
    """Create the run directory and write the resolved config into it."""
    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str))
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        (out / name).unlink(missing_ok=True)
    return out


def worker_env(cfg: Config, device: str) -> dict[str, str]:
    """Environment every worker process starts with (read by torch and vLLM at import)."""
    env = {"TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if device == "cpu":
        env |= {"OMP_NUM_THREADS": str(cfg.trainer.cpus_per_proc), "VLLM_CPU_KVCACHE_SPACE": str(cfg.rollout.cpu_kv_cache_gb)}
    else:
        env |= {"NCCL_CUMEM_ENABLE": "0"}
    return env


def import_class(path: str) -> type:
    """``pkg.module.Class`` -> the class (worker classes are named by path, never imported here)."""
    import importlib

    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"actor.worker_cls={path!r} cannot be imported: {e}") from e


def run_training(cfg: Config) -> list[dict[str, float]]:
    """Start or join Ray, place the workers, train, and tear everything down.

    Returns the metrics of every step (also written to ``metrics.jsonl``).
    """
    started = init_ray(cfg.ray)
    import ray
    from transformers import AutoTokenizer

    from rlframe.controller.placement import ResourcePool
    from rlframe.controller.worker_group import WorkerGroup
    from rlframe.data.prompts import load_prompt_records
    from rlframe.data.tiny_model import resolve_model_path

    pool, actor, tracker = None, None, None
    try:
        device = resolve_device(cfg.trainer.device)
        # Resolved (and a tiny model built) here, once, so workers never race to build it.
        model_path = resolve_model_path(cfg.model.path)
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
        records = load_prompt_records(
            cfg.data.train_files, cfg.data.task, tokenizer, cfg.data.max_prompt_length, cfg.trainer.seed
        )
        out = prepare_output_dir(cfg)
        pool = ResourcePool(
            nnodes=cfg.trainer.nnodes,
            procs_per_node=cfg.trainer.procs_per_node,
            device=device,
            cpus_per_proc=cfg.trainer.cpus_per_proc,
            name="actor_rollout",
        )
        pool.create()
        actor = WorkerGroup(
            pool, import_class(cfg.actor.worker_cls), role="actor", init_args=(cfg, model_path, device),
            call_timeout_s=cfg.ray.call_timeout_s, env=worker_env(cfg, device),
        )
        tracker = Tracker(out, cfg.trainer.loggers, cfg.trainer.total_steps, cfg, cfg.trainer.project, cfg.trainer.experiment)
        loader = PromptLoader(records, cfg.data.batch_size, cfg.trainer.seed)
        return Trainer(cfg, actor, tokenizer, loader, tracker).fit()
    finally:
        if tracker is not None:
            tracker.close()
        if actor is not None:
            actor.shutdown()
        if pool is not None:
            pool.remove()
        if started:
            ray.shutdown()
