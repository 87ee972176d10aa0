"""The launcher: the run directory, Ray, the worker pools and groups, then the training loop.

:func:`run_training` builds what the loop is given: the worker groups, the experience
producer (with the reward stage) and the two callables at the weight seam, ``generate``
(prompt rows -> responses, for the producer) and ``sync_weights`` (training weights -> the
rollout engines, returning the new weights version, for the trainer).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from rlframe.config import Config
from rlframe.controller.cluster import RayStart, describe_cluster, import_ray, resolve_device
from rlframe.observability import startup
from rlframe.observability.logs import (
    DriverLogs,
    describe_run,
    format_startup_summary,
    route_driver_logs,
)
from rlframe.run.interrupts import install_interrupt_handlers, raise_if_interrupted
from rlframe.run.started import Started
from rlframe.state.checkpoint import read_driver_state, truncate_run_logs
from rlframe.state.run_dir import lock_run_dir

if TYPE_CHECKING:
    from rlframe.run.pools import Workers
    from rlframe.run.preflight import RunInputs, WorkerInputs


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


def run_training(cfg: Config, resume_from: Path | None) -> list[dict[str, float]]:
    """Start or join Ray, place the workers, train, and tear everything down, checking the
    rest of the run's inputs on the way. Returns the metrics of every step (also written to
    ``metrics.jsonl``).

    The checks overlap the start-up (:mod:`rlframe.run.preflight`): the run directory, the
    pools' fit, the config against the model's ``config.json`` and a fixed port came before
    (:func:`~rlframe.run.preflight.check_before_ray`, whose ``resume_from`` this is); what the
    workers are built from (plug-ins, worker classes, the model folder) is checked while Ray
    starts; the tokenizer and the prompts while the workers construct. A check that fails
    stops whatever had started, and the run ends with its one config-error line.
    """
    lock_run_dir(cfg.trainer.output_dir)  # held already when started from rlframe.main
    import_ray(cfg.ray)
    # Before Ray starts: its start-up lines go to driver.log (logs/ is not a run file).
    logs = route_driver_logs(Path(cfg.trainer.output_dir), cfg.trainer.log_level)
    startup.DRIVER.mark("preflight")
    run = Started(logs)
    try:
        found, started_here = start_ray(cfg, resume_from, run)
        out, device = open_run_dir(cfg, resume_from, found, started_here, logs)
        workers, inputs = start_pools(cfg, device, found, logs, run)
        from rlframe.run.assembly import build_loop, resume_and_push_weights

        trainer, checkpointer = build_loop(cfg, out, device, found, workers, inputs, run)
        resume_and_push_weights(trainer, checkpointer, resume_from, workers)
        raise_if_interrupted()
        startup.report_first_step(trainer.step_count + 1)
        history = trainer.fit()
        print(describe_finished_run(history, out), flush=True)
        return history
    finally:
        run.close()


def start_ray(cfg: Config, resume_from: Path | None, run: Started) -> tuple[WorkerInputs, bool]:
    """Start or join Ray on a thread of its own and, meanwhile, check what the workers are
    built from (plug-ins, worker classes, the model folder). Returns those inputs, and
    whether this run started a local Ray.

    Ray's start comes first: the worker classes' imports (torch) take seconds of the
    driver's own, which overlap it. The loop's own modules (:mod:`rlframe.run.assembly`) are
    imported later still, beside the workers' start (:func:`start_pools`): the workers need
    none of them."""
    run.ray = ray_start = RayStart(cfg.ray)
    startup.DRIVER.mark("ray")
    from rlframe.run.preflight import check_worker_inputs

    found = check_worker_inputs(cfg, resume_from)
    raise_if_interrupted()  # a signal a library's import swallowed: stop here, not later
    startup.DRIVER.mark("preflight")
    started_here = ray_start.wait()
    startup.DRIVER.mark("ray")
    startup.DRIVER.attach("ray", {"ray start": ray_start.seconds})
    install_interrupt_handlers()  # again: Ray may have replaced ours for SIGTERM
    return found, started_here


def open_run_dir(
    cfg: Config,
    resume_from: Path | None,
    found: WorkerInputs,
    started_here: bool,
    logs: DriverLogs,
) -> tuple[Path, str]:
    """The run directory (with its resolved config) and the device; prints the start-up
    summary."""
    out = prepare_output_dir(
        cfg, None if resume_from is None else read_driver_state(resume_from)["step"]
    )
    device = resolve_device(cfg.trainer.device)
    cluster = describe_cluster(started_here)
    print(
        format_startup_summary(describe_run(cfg, found.model_path, device, out, logs, cluster)),
        flush=True,
    )
    return out, device


def start_pools(
    cfg: Config, device: str, found: WorkerInputs, logs: DriverLogs, run: Started
) -> tuple[Workers, RunInputs]:
    """Place the pools and start the worker groups; the loop's imports and the driver's own
    checks (tokenizer, prompts) run while the workers construct. Returns the groups and the
    checked inputs."""
    from rlframe.run.pools import Launch, start_workers
    from rlframe.run.preflight import check_driver_inputs

    run.launch = launch = Launch(
        cfg,
        device,
        found.model_path,
        found.reward_model_path,
        lambda cpus: worker_env(cfg, device, cpus) | logs.worker_env(),
        [],
        [],
        found.served_paths,
    )
    checked: list[tuple[RunInputs, float]] = []

    def check_while_workers_start() -> None:
        began = time.time()
        import rlframe.run.assembly  # noqa: F401  (the loop's modules, beside the workers' start)

        checked.append((check_driver_inputs(cfg, found), time.time() - began))

    workers = start_workers(launch, check_while_workers_start)
    raise_if_interrupted()
    startup.DRIVER.mark("workers")
    inputs, seconds = checked[0]
    startup.DRIVER.attach("workers", {"driver checks": seconds, "placement": launch.placement_s})
    return workers, inputs
