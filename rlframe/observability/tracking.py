"""Metric sinks (console, metrics.jsonl, TensorBoard, wandb), stage timers and the rollout log."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

CONSOLE_KEYS = (
    ("reward/mean", "reward"),
    ("response_length/mean", "len"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/entropy", "entropy"),
    ("actor/kl", "kl"),
    ("actor/grad_norm", "grad"),
    ("rollout/logprob_diff", "lp_diff"),
    ("timing_s/step", "s/step"),
)


class StageTimer:
    """Wall-clock seconds per named stage of a step, as ``timing_s/<stage>`` metrics."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}


class Tracker:
    """Sends each step's metrics to the configured sinks and keeps sample rollouts."""

    def __init__(
        self,
        output_dir: Path,
        loggers: list[str],
        total_steps: int,
        run_config: Any,
        project: str,
        experiment: str,
    ):
        self.output_dir, self.loggers, self.total_steps = output_dir, loggers, total_steps
        self.metrics_path = output_dir / "metrics.jsonl"
        self.rollouts_path = output_dir / "rollouts.jsonl"
        self.run_config, self.project, self.experiment = run_config, project, experiment
        self.wandb_run: Any = None
        self.wandb_run_id: str | None = None
        self.tensorboard: Any = None

    def start_wandb(self) -> None:
        """Open the wandb run on first use, so a resumed run can first load the id it continues."""
        import wandb

        config = self.run_config
        # A dataclass instance (the run's Config) becomes a dict; anything else goes as it is.
        if is_dataclass(config) and not isinstance(config, type):
            config = asdict(config)
        self.wandb_run = wandb.init(
            project=self.project,
            name=self.experiment,
            config=config,
            dir=str(self.output_dir),
            id=self.wandb_run_id,
            resume="allow" if self.wandb_run_id else None,
        )
        self.wandb_run_id = self.wandb_run.id

    def start_tensorboard(self, first_step: int) -> None:
        """Event files in ``<output_dir>/tensorboard``. Events at or after the first step logged
        now are purged: a resumed run replaces what the crashed run logged after its checkpoint."""
        from torch.utils.tensorboard import SummaryWriter

        self.tensorboard = SummaryWriter(
            log_dir=str(self.output_dir / "tensorboard"), purge_step=first_step
        )

    def state_dict(self) -> dict[str, Any]:
        return {"wandb_run_id": self.wandb_run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the checkpoint's wandb run instead of opening a second one."""
        self.wandb_run_id = state.get("wandb_run_id")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if "wandb" in self.loggers and self.wandb_run is None:
            self.start_wandb()
        if "jsonl" in self.loggers:
            append_lines(self.metrics_path, json.dumps({"step": step, **metrics}) + "\n")
        if "console" in self.loggers:
            print(format_console_line(step, self.total_steps, metrics), flush=True)
            if any(key.startswith("val/") for key in metrics):
                print(format_validation_line(step, metrics), flush=True)
        if "tensorboard" in self.loggers:
            if self.tensorboard is None:
                self.start_tensorboard(step)
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, global_step=step)
            self.tensorboard.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)

    def log_rollouts(self, step: int, rows: list[dict[str, Any]]) -> None:
        lines = "".join(json.dumps({"step": step, **row}) + "\n" for row in rows)
        append_lines(self.rollouts_path, lines)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def append_lines(path: Path, text: str) -> None:
    """Append ``text`` (whole lines) to ``path``, or nothing: a write the disk cannot hold is
    taken back, so the file keeps whole lines for a resume to read, and the error names the
    file (a buffered file's failing close names none)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        start = os.fstat(fd).st_size
        left = memoryview(text.encode())
        try:
            while left:
                left = left[os.write(fd, left) :]
        except OSError as e:
            os.ftruncate(fd, start)
            raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        os.close(fd)


def format_console_line(step: int, total: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step}/{total}"]
    parts += [f"{label} {metrics[key]:.4g}" for key, label in CONSOLE_KEYS if key in metrics]
    return " | ".join(parts)


def format_validation_line(step: int, metrics: dict[str, float]) -> str:
    """``val step N | reward .. | score .. | len .. | pass@1 .. | pass@k ..`` (overall only;
    the per-data-source figures are in metrics.jsonl)."""
    parts = [f"val step {step}"]
    for key, label in (
        ("val/reward/mean", "reward"),
        ("val/score/mean", "score"),
        ("val/response_length/mean", "len"),
    ):
        if key in metrics:
            parts.append(f"{label} {metrics[key]:.4g}")
    passes = sorted(
        (int(k.removeprefix("val/pass@")), v)
        for k, v in metrics.items()
        if k.startswith("val/pass@") and k.removeprefix("val/pass@").isdigit()
    )
    parts += [f"pass@{k} {v:.4g}" for k, v in passes]
    return " | ".join(parts)
