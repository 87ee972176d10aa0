"""The one way tests run rlframe's command line.

- :func:`run_recipe` runs a recipe with overrides **in the test process**, through the same
  entry point as ``python -m rlframe.main`` (override checks, Hydra, config validation,
  pre-flight, the launcher), on the test session's Ray cluster (the ``ray_cluster`` fixture).
  It saves each run the interpreter start, the driver imports and a Ray start (about 15 s on
  2 cores). It returns the per-step metrics, the console and the run directory.
- :func:`check_cli` runs the same entry point in-process for commands that must stop before
  the workers start (config errors, ``--help``, ``--cfg job``). The launcher's checks
  (:func:`rlframe.run.preflight.check_worker_inputs` and ``check_driver_inputs``, which a real
  run makes while Ray and the workers start) run alone, without Ray; a command that passes
  them fails the test (``before_ray=True``: a command that reaches the launcher at all).
- :func:`spawn_cli` starts ``python -m rlframe.main`` as a child process. Use it only where the
  process is what the test checks: exit codes of a fresh process, signals, the console of a
  fresh interpreter, ``ray job submit``, loopback binding, run-directory locking, imports.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VARYING = (
    "timing_s/",
    "perf/",
    "startup_s/",
    "rollout/requests/",
    "rollout/in_flight/",
    "rollout/prefix_cache_hit",
)
"""Wall-clock figures, and the request stream's scheduling figures (which requests ran in a
step's window, beside which others: a resumed run served some before its checkpoint):
everything else a step logs must match bit for bit between runs."""


@dataclass
class RunResult:
    """What one run left: its exit status, console and run directory."""

    exit_code: int
    """0 for a finished run; 2 for a config error, 1 for a failure, 128+N for a signal."""
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """One dict per logged step (``metrics.jsonl``); empty when none was logged."""
        return read_metrics(self.run_dir)

    @property
    def steps(self) -> list[str]:
        """The console's step lines."""
        return [line for line in self.stdout.splitlines() if line.startswith("step ")]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def deterministic(metrics: dict[str, Any]) -> dict[str, Any]:
    """A step's metrics without its wall-clock figures."""
    return {k: v for k, v in metrics.items() if not k.startswith(VARYING)}


def mean_reward_gain(metrics: list[dict[str, Any]]) -> tuple[float, float]:
    """Mean reward over the first five and the last five steps."""
    rewards = [m["reward/mean"] for m in metrics]
    return sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5


@contextlib.contextmanager
def kept_signal_handlers() -> Iterator[None]:
    """The launcher installs its SIGINT/SIGTERM handlers: give pytest its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        from rlframe.run.interrupts import RECEIVED

        RECEIVED.clear()


def call_main(args: list[str]) -> tuple[int, str, str]:
    """``rlframe.main.main()`` with ``args`` as its command line, in this process: (exit
    status, stdout, stderr)."""
    from rlframe import main as entry

    out, err = io.StringIO(), io.StringIO()
    code = 0
    saved_argv = sys.argv
    sys.argv = ["rlframe.main", *args]
    try:
        with (
            kept_signal_handlers(),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            try:
                entry.main()
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.argv = saved_argv
    return code, out.getvalue(), err.getvalue()


def run_recipe(
    run_dir: Path, *overrides: str, recipe: str = "grpo_tiny", expect_exit: int = 0
) -> RunResult:
    """Run ``+recipe=RECIPE trainer.output_dir=RUN_DIR OVERRIDES`` in this process, on the
    session's Ray cluster (use the ``ray_cluster`` fixture). Checks the exit status and, for a
    finished run, that every step was logged once, in order, with finite numbers."""
    import ray

    assert ray.is_initialized(), "run_recipe needs the ray_cluster fixture"
    args = [f"+recipe={recipe}", f"trainer.output_dir={run_dir}", *overrides]
    try:
        code, stdout, stderr = call_main(args)
    finally:
        release_all_run_dirs()  # as a CLI run's exit would: the next run may take the folder
    result = RunResult(code, stdout, stderr, Path(run_dir))
    assert code == expect_exit, f"exit {code}, expected {expect_exit}:\n{stderr[-5000:]}"
    if code == 0:
        check_finished_run(result)
    return result


def check_finished_run(result: RunResult) -> None:
    metrics = result.metrics
    assert result.steps, "no step line on the console"
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    for m in metrics:  # a NaN or inf anywhere (losses, critic values, timings) is a broken run
        bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"step {m['step']}: {bad}"
    assert (result.run_dir / "config.json").is_file()


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


class LauncherReached(AssertionError):
    """A command that should have stopped before Ray reached the launcher."""


def check_cli(*args: str, env: dict[str, str] | None = None, before_ray: bool = False) -> CliResult:
    """Run the command line in this process for a command that must stop before the workers
    start: a config error, ``--help``, ``--cfg job``. The checks before Ray run as in a real
    run (in ``rlframe.main``); the launcher's (:func:`rlframe.run.preflight.check_worker_inputs`
    and :func:`~rlframe.run.preflight.check_driver_inputs`, which a real run makes while Ray and
    the workers start) run here without Ray, unless ``before_ray``: then reaching the launcher
    at all fails. Passing them fails with :class:`LauncherReached`.

    Without ``trainer.output_dir`` in ``args`` the run directory is a fresh temporary folder, so
    nothing lands in the recipe's own ``outputs/``."""
    import rlframe.run.launch
    from rlframe.config import Config
    from rlframe.run.preflight import check_driver_inputs, check_worker_inputs

    if not any(a.startswith("trainer.output_dir=") or a in ("--cfg", "--help") for a in args):
        args = (*args, f"trainer.output_dir={tempfile.mkdtemp(prefix='rlframe-cli-')}/run")

    reached: list[str] = []

    def refuse(cfg: Config, resume_from: Path | None) -> list[dict[str, float]]:
        # The launcher checks the run's inputs while Ray and the workers start: here they
        # are checked alone, and a run that passes them is refused.
        if not before_ray:
            check_driver_inputs(cfg, check_worker_inputs(cfg, resume_from))
        # Hydra turns an exception in the run into exit 1: keep the fact, raise it after.
        reached.append(f"{' '.join(args)} reached the launcher (Ray would start)")
        raise LauncherReached(reached[-1])

    saved_env = dict(os.environ)
    saved_run = rlframe.run.launch.run_training
    os.environ.update(env or {})
    rlframe.run.launch.run_training = refuse
    try:
        code, stdout, stderr = call_main(list(args))
    finally:
        release_all_run_dirs()
        rlframe.run.launch.run_training = saved_run
        os.environ.clear()
        os.environ.update(saved_env)
    if reached:
        raise LauncherReached(reached[0])
    return CliResult(code, stdout, stderr)


def release_all_run_dirs() -> None:
    """Drop the run-directory locks this process took (a CLI run drops them at exit)."""
    from rlframe.state.run_dir import HELD, release_run_dir

    for path in list(HELD):
        release_run_dir(path)


@contextlib.contextmanager
def shipped_by_value(module: ModuleType) -> Iterator[None]:
    """Ray workers cannot import the tests package: while this holds, ``module``'s classes
    (a plug-in worker class of a test) travel to them by value."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        cloudpickle.unregister_pickle_by_value(module)


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test process's environment for a child run: its own local Ray, not the session's."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return env | (extra or {})


def spawn_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    """``python -m rlframe.main ARGS`` as a child process (its own interpreter and local Ray)."""
    return subprocess.run(
        [sys.executable, "-m", "rlframe.main", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        env=env if env is not None else clean_env(),
        cwd=cwd,
    )


def cli_command(*args: str) -> list[str]:
    """The argv of ``python -m rlframe.main ARGS``, for tests that drive the process themselves
    (signals, kills)."""
    return [sys.executable, "-m", "rlframe.main", *args]
