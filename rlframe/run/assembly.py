"""The training loop's parts, built once the workers are up: the experience producer (with the
reward stage), the checkpointer, the validator, the distillation stage and the trainer.

:mod:`rlframe.run.launch` imports this module beside the workers' start, long after Ray's
start began: what it imports (the loop, the rollout and agent code) takes seconds of the
driver's, which the workers do not need.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rlframe.agent_server import pick_agent
from rlframe.config import Config, Placement
from rlframe.data.loader import PromptLoader
from rlframe.loop.distillation import Distillation
from rlframe.loop.sync_check import SyncCheck
from rlframe.loop.trainer import Trainer
from rlframe.loop.validation import Validator
from rlframe.observability import startup
from rlframe.observability.tracking import Tracker
from rlframe.rewards.stage import RewardStage
from rlframe.rollout import ExperienceProducer, Producer
from rlframe.run.judge import build_judge_stage
from rlframe.run.started import Started
from rlframe.state.checkpoint import Checkpointer, write_hf_config

if TYPE_CHECKING:
    from rlframe.core.tokenizer import Tokenizer
    from rlframe.run.pools import Workers
    from rlframe.run.preflight import RunInputs, WorkerInputs


def build_producer(
    cfg: Config, workers: Workers, tokenizer: Tokenizer, loader: PromptLoader, rewards: RewardStage
) -> tuple[Producer, Callable[[], int]]:
    """The experience producer and the ``sync_weights`` the trainer calls (the producer learns
    each new weights version from it). A separate rollout pool generates ahead while the
    trainer trains, at ``rollout.max_staleness >= 1``."""
    overlap = cfg.rollout.placement is Placement.separate and cfg.rollout.max_staleness > 0
    agent = pick_agent(cfg.rollout.agent)
    producer = ExperienceProducer(
        cfg, workers.generate, tokenizer, loader, rewards, overlap, agent, workers.engine
    )
    return producer, producer.track_sync(workers.sync_weights)


def build_loop(
    cfg: Config,
    out: Path,
    device: str,
    found: WorkerInputs,
    workers: Workers,
    inputs: RunInputs,
    run: Started,
) -> tuple[Trainer, Checkpointer]:
    """The loop's parts: the tracker, the prompt loader, the checkpointer, the reward stage,
    the experience producer, the validator, and the trainer that drives them."""
    tokenizer, val_records = inputs.tokenizer, inputs.val_records
    actor, critic = workers.actor, workers.critic
    t = cfg.trainer
    run.tracker = tracker = Tracker(out, t.loggers, t.total_steps, cfg, t.project, t.experiment)
    loader = PromptLoader(inputs.records, cfg.data.batch_size, t.seed)
    checkpointer = build_checkpointer(cfg, out, found.model_path, tokenizer, workers)
    judge = build_judge_stage(cfg, workers.served, found.served_paths.get("judge", ""))
    rewards = RewardStage(cfg, tokenizer, workers.reward_model, judge)
    experience, sync_weights = build_producer(cfg, workers, tokenizer, loader, rewards)
    run.experience = experience
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
        SyncCheck.for_run(cfg, device),
        workers.read_sync_check,
        build_distillation(cfg, workers, found, device),
    )
    return trainer, checkpointer


def build_distillation(
    cfg: Config, workers: Workers, found: WorkerInputs, device: str
) -> Distillation | None:
    """The teachers' stage, check and objective when ``distill`` names a teacher."""
    if not cfg.distill.enabled:
        return None
    teachers = {name: m for name, m in workers.served.items() if name.startswith("teacher")}
    return Distillation(cfg, teachers, found.served_paths, device)


def build_checkpointer(
    cfg: Config, out: Path, model_path: str, tokenizer: Tokenizer, workers: Workers
) -> Checkpointer:
    """Saves the actor's (and the critic's) state into the run directory, with the model's
    Hugging Face config beside it."""
    critic = workers.critic
    return Checkpointer(
        out,
        cfg.trainer.keep_last,
        {"actor": workers.actor} | ({"critic": critic} if critic is not None else {}),
        lambda dest: write_hf_config(
            model_path, tokenizer, dest, cfg.model.trust_remote_code, cfg.model.lora
        ),
        cfg.trainer.export_hf,
    )


def resume_and_push_weights(
    trainer: Trainer, checkpointer: Checkpointer, resume_from: Path | None, workers: Workers
) -> None:
    """Load a resumed run's checkpoint; then a separate rollout pool, which loaded the model
    itself, gets exactly the trainer's weights (the resumed ones, under their version)."""
    if resume_from is not None:
        trainer.load_state_dict(checkpointer.load(resume_from))
        print(f"rlframe: resumed from {resume_from} at step {trainer.step_count}", flush=True)
    if workers.push_current is not None:
        workers.push_current()
        startup.DRIVER.mark("first_sync")
