"""The launcher: the run directory, Ray, the worker pools and groups, then the training loop.

:func:`run_training` builds what the loop is given: the worker groups, the experience
producer (with the reward stage) and the two callables at the weight seam, ``generate``
(prompt rows -> responses, for the producer) and ``sync_weights`` (training weights -> the
rollout engines, returning the new weights version, for the trainer).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from rlframe.agent_server import pick_agent
from rlframe.config import Config, Placement
from rlframe.controller.cluster import describe_cluster, resolve_device
from rlframe.data.loader import PromptLoader
from rlframe.loop.sync_check import pick_max_logprob_diff
from rlframe.loop.trainer import Trainer
from rlframe.loop.validation import Validator
from rlframe.observability import startup
from rlframe.observability.logs import describe_run, format_startup_summary, route_driver_logs
from rlframe.observability.tracking import Tracker
from rlframe.rewards.stage import RewardStage
from rlframe.rollout import ExperienceProducer, Producer
from rlframe.run.interrupts import install_interrupt_handlers
from rlframe.state.checkpoint import (
    Checkpointer,
    read_driver_state,
    truncate_run_logs,
    write_hf_config,
)
from rlframe.state.run_dir import lock_run_dir

if TYPE_CHECKING:
    from rlframe.controller.cluster import RayStart
    from rlframe.core.tokenizer import Tokenizer
    from rlframe.run.pools import Workers
    from rlframe.run.preflight import RunInputs


def prepare_output_dir(cfg: Config, resume_step: int | None) -> Path:
    """Create the run directory and write the resolved config into it. Nothing is deleted: a
    resumed run writes ``config.resume_<step>.json`` and drops only the log lines after its
    checkpoint (see :func:`rlframe.state.checkpoint.resolve_resume` for a directory in use)."""
    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "config.json" if resume_step is None else f"config.resume_{resume_step}.json"
    (out / name).write_text(json.dumps(asdict(cfg), indent=2, default=str))
    if resume_step is not None:
        truncate_run_logs(out, resume_step)
    return out


def worker_env(cfg: Config, device: str, cpus_per_proc: int | None = None) -> dict[str, str]:
    """Environment every worker process starts with (read by torch at import). vLLM's own
    variables are set by the vLLM engine (``workers/inference/vllm_rollout.py``), their one
    owner, from ``rollout.*``. ``cpus_per_proc``: the pool's bundle size (default
    ``trainer.cpus_per_proc``; a separate rollout pool has its own)."""
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if device == "cpu":
        # vLLM's CPU worker turns torch.set_num_threads into a no-op: the count is set here.
        env |= {"OMP_NUM_THREADS": str(cpus_per_proc or cfg.trainer.cpus_per_proc)}
    else:
        env |= {"NCCL_CUMEM_ENABLE": "0"}
    return env


def build_producer(
    cfg: Config, workers: Workers, tokenizer: Tokenizer, loader: PromptLoader, rewards: RewardStage
) -> tuple[Producer, Callable[[], int]]:
    """The experience producer and the ``sync_weights`` the trainer calls (the producer learns
    each new weights version from it). A separate rollout pool generates ahead while the
    trainer trains, at ``rollout.max_staleness >= 1``."""
    overlap = cfg.rollout.placement is Placement.separate and cfg.rollout.max_staleness > 0
    agent = pick_agent(cfg.rollout.agent)
    producer = ExperienceProducer(cfg, workers.generate, tokenizer, loader, rewards, overlap, agent)
    return producer, producer.track_sync(workers.sync_weights)


def describe_finished_run(history: list[dict[str, float]], out: Path) -> str:
    """The run's last console line: steps, wall time, the reward trend, where outputs are."""
    wall = startup.DRIVER.total_since_origin()
    text = f"rlframe: done: {len(history)} step(s) in {wall:.0f} s"
    rewards = [m["reward/mean"] for m in history if "reward/mean" in m]
    if rewards:
        head, tail = rewards[:5], rewards[-5:]
        text += (
            f"; reward {sum(head) / len(head):.3f} (first {len(head)}) -> "
            f"{sum(tail) / len(tail):.3f} (last {len(tail)})"
        )
    return text + f"; outputs in {out.resolve()}"


def run_training(cfg: Config) -> list[dict[str, float]]:
    """Check the run's inputs, start or join Ray, place the workers, train, and tear
    everything down. Returns the metrics of every step (also written to ``metrics.jsonl``).

    The checks overlap the start-up (:mod:`rlframe.run.preflight`): the run directory and the
    pools' fit come before Ray; what the workers are built from (plug-ins, worker classes,
    the model folder) is checked while Ray starts; the tokenizer and the prompts while the
    workers construct. A check that fails stops whatever had started, and the run ends with
    its one config-error line.
    """
    from rlframe.controller.cluster import RayStart
    from rlframe.run.preflight import check_before_ray, check_driver_inputs, check_worker_inputs

    lock_run_dir(cfg.trainer.output_dir)  # held already when started from rlframe.main
    resume_from = check_before_ray(cfg)
    # Before Ray starts: its start-up lines go to driver.log (logs/ is not a run file).
    logs = route_driver_logs(Path(cfg.trainer.output_dir), cfg.trainer.log_level)
    startup.DRIVER.mark("preflight")
    ray_start: RayStart | None = None
    tracker, experience, launch = None, None, None
    try:
        ray_start = RayStart(cfg.ray)
        startup.DRIVER.mark("ray")
        found = check_worker_inputs(cfg, resume_from)
        startup.DRIVER.mark("preflight")
        started = ray_start.wait()
        startup.DRIVER.mark("ray")
        startup.DRIVER.attach("ray", {"ray start": ray_start.seconds})
        install_interrupt_handlers()  # again: Ray may have replaced ours for SIGTERM
        from rlframe.run.pools import Launch, start_workers

        model_path = found.model_path
        out = prepare_output_dir(
            cfg, None if resume_from is None else read_driver_state(resume_from)["step"]
        )
        device = resolve_device(cfg.trainer.device)
        print(
            format_startup_summary(
                describe_run(cfg, model_path, device, out, logs, describe_cluster(started))
            ),
            flush=True,
        )
        launch = Launch(
            cfg,
            device,
            model_path,
            found.reward_model_path,
            lambda cpus: worker_env(cfg, device, cpus) | logs.worker_env(),
            [],
            [],
        )
        checked: list[tuple[RunInputs, float]] = []

        def check_while_workers_start() -> None:
            began = time.time()
            checked.append((check_driver_inputs(cfg, found), time.time() - began))

        workers = start_workers(launch, check_while_workers_start)
        startup.DRIVER.mark("workers")
        inputs, seconds = checked[0]
        startup.DRIVER.attach("workers", {"driver checks": seconds})
        tokenizer, records, val_records = inputs.tokenizer, inputs.records, inputs.val_records
        actor, critic = workers.actor, workers.critic
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
            lambda dest: write_hf_config(
                model_path, tokenizer, dest, cfg.model.trust_remote_code, cfg.model.lora
            ),
            cfg.trainer.export_hf,
        )
        rewards = RewardStage(cfg, tokenizer, workers.reward_model)
        experience, sync_weights = build_producer(cfg, workers, tokenizer, loader, rewards)
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
            sync_weights,
            tracker,
            checkpointer,
            validator,
            pick_max_logprob_diff(cfg, device),
        )
        if resume_from is not None:
            trainer.load_state_dict(checkpointer.load(resume_from))
            print(f"rlframe: resumed from {resume_from} at step {trainer.step_count}", flush=True)
        if workers.push_current is not None:
            # A separate rollout pool loaded the model itself; from now on it holds exactly
            # the trainer's weights (the resumed ones, under their version).
            workers.push_current()
            startup.DRIVER.mark("first_sync")
        startup.report_first_step(trainer.step_count + 1)
        history = trainer.fit()
        print(describe_finished_run(history, out), flush=True)
        return history
    finally:
        if experience is not None:
            experience.close()
        if tracker is not None:
            tracker.close()
        if launch is not None:
            launch.shutdown()
        if ray_start is not None:
            ray_start.stop()
        logs.close()
