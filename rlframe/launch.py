"""The launcher: the run directory, Ray, the worker pools and groups, then the training loop.

:func:`run_training` builds what the loop is given: the worker groups, the experience
producer (with the reward stage) and the two callables at the weight seam, ``generate``
(prompt rows -> responses, for the producer) and ``sync_weights`` (training weights -> the
rollout engines, returning the new weights version, for the trainer).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlframe.algorithms.registry import load_class
from rlframe.checkpoint import Checkpointer, read_driver_state, truncate_run_logs, write_hf_config
from rlframe.config import Config
from rlframe.controller.cluster import init_ray, resolve_device
from rlframe.data.loader import PromptLoader
from rlframe.logs import describe_run, format_startup_summary, route_driver_logs
from rlframe.preflight import RunInputs
from rlframe.rewards.stage import RewardStage
from rlframe.rollout import ExperienceProducer
from rlframe.tracking import Tracker
from rlframe.trainer import Trainer
from rlframe.validation import Validator


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
    """Environment every worker process starts with (read by torch at import). vLLM's own
    variables are set by the vLLM engine (``workers/engines/vllm_rollout.py``), their one
    owner, from ``rollout.*``."""
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if device == "cpu":
        # vLLM's CPU worker turns torch.set_num_threads into a no-op: the count is set here.
        env |= {"OMP_NUM_THREADS": str(cfg.trainer.cpus_per_proc)}
    else:
        env |= {"NCCL_CUMEM_ENABLE": "0"}
    return env


def build_colocated_sync(actor: Any) -> Callable[[], int]:
    """Colocated placement: each hybrid rank copies its training weights into its own engine."""

    def sync_weights() -> int:
        return int(actor.sync_weights()[0])

    return sync_weights


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
    pool, tracker, experience, groups = None, None, None, []
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
        rewards = RewardStage(cfg, tokenizer, reward_model)
        experience = ExperienceProducer(cfg, actor.generate, tokenizer, loader, rewards)
        validator = (
            Validator(val_records, cfg, tokenizer, experience.generate, rewards)
            if val_records
            else None
        )
        trainer = Trainer(
            cfg,
            actor,
            critic,
            experience,
            build_colocated_sync(actor),
            tracker,
            checkpointer,
            validator,
        )
        if resume_from is not None:
            trainer.load_state_dict(checkpointer.load(resume_from))
            print(f"rlframe: resumed from {resume_from} at step {trainer.step_count}", flush=True)
        return trainer.fit()
    finally:
        if experience is not None:
            experience.close()
        if tracker is not None:
            tracker.close()
        for group in groups:
            group.shutdown()
        if pool is not None:
            pool.remove()
        if started:
            ray.shutdown()
        logs.close()
