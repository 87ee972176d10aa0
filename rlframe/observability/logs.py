"""Where a run's output goes: files under ``<run dir>/logs/`` hold everything; the console
keeps what a person reads.

- ``logs/driver.log``: the driver's Python logging (rlframe, Ray's driver messages, Python
  warnings), at INFO (DEBUG with ``trainer.log_level=debug``).
- ``logs/<role>_rank<r>.log``: everything a worker process writes to stdout and stderr
  (vLLM's INFO lines, library warnings with their tracebacks, gloo and OpenMP chatter). The
  worker redirects its file descriptors 1 and 2 there when it starts, so C-level output is
  caught too.
- ``logs/ray``: a link to the Ray session's own log folder (raylet, GCS, dashboard, agents)
  when the driver's node is part of the cluster.

The console shows the start-up summary, the per-step line (printed by the tracker),
rlframe's warnings and errors, Ray's warnings and errors except the ones listed in
:data:`HARMLESS`, and warnings a worker logs through the ``rlframe``/``workers`` loggers
(Ray forwards those with a ``(HybridWorker pid=...)`` prefix). ``trainer.log_level`` moves
the console threshold: ``info`` adds Ray's and rlframe's INFO lines, ``error`` keeps errors
only.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlframe.config import Config

LOG_DIR_ENV = "RLFRAME_LOG_DIR"
"""Set on worker processes: the folder their stdout/stderr files go into."""
LOG_LEVEL_ENV = "RLFRAME_LOG_LEVEL"
"""Set on worker processes: the console threshold (``trainer.log_level``)."""
LEVELS = ("debug", "info", "warning", "error")

# Warnings that say nothing a user can act on; they stay in the files.
HARMLESS = (
    # A local cluster started here is on loopback and keeps Ray's default token auth on.
    "Token authentication is enabled for this Ray cluster",
    "Token authentication is disabled for this Ray cluster",
    # Ray's own advice about its shared-memory size on machines with a small /dev/shm.
    "The object store is using /tmp instead of /dev/shm",
    # Ray starts on a thread of its own (rlframe.controller.cluster.RayStart); the run's
    # handlers are the driver's.
    "SIGTERM handler is not set because current thread is not the main thread",
)

QUIET_LOGGERS = ("httpx", "httpcore", "httpx2", "httpcore2", "openai")
"""Client libraries an agent of ``rollout.agent=openai`` calls the endpoint through: below
WARNING only at ``trainer.log_level=debug``. The openai package's transport is ``httpx``
(``httpcore``) up to openai 2, ``httpx2`` (``httpcore2``) in openai 3."""

CONSOLE_FORMAT = "%(levelname)s %(name)s: %(message)s"
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class DriverLogFile(logging.FileHandler):
    """``driver.log``. A record the disk cannot take is dropped, without the traceback that
    logging prints for each one: the run's own writes (metrics.jsonl) report a full disk,
    once, and end the run."""

    def handleError(self, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handleError(record)

    def close(self) -> None:
        try:
            super().close()
        except OSError:
            pass  # what was buffered for a full disk is lost with it


class ConsoleFilter(logging.Filter):
    """Drops the records listed in :data:`HARMLESS`."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in HARMLESS)


def level_number(name: str) -> int:
    return int(getattr(logging, name.upper()))


@dataclass
class DriverLogs:
    """The driver's routing, undone by :meth:`close` (tests run several runs per process)."""

    log_dir: Path
    level: str
    handlers: list[logging.Handler] = field(default_factory=list)
    root_level: int = logging.WARNING
    root_handlers: list[logging.Handler] = field(default_factory=list)
    ray_handlers: list[logging.Handler] = field(default_factory=list)
    ray_propagate: bool = False
    quiet_levels: dict[str, int] = field(default_factory=dict)

    def worker_env(self) -> dict[str, str]:
        """Environment that makes a worker write into this run's ``logs/``."""
        env = {LOG_DIR_ENV: str(self.log_dir), LOG_LEVEL_ENV: self.level}
        if self.level == "debug":
            env["VLLM_LOGGING_LEVEL"] = "DEBUG"
        return env

    def link_ray_logs(self) -> Path | None:
        """``logs/ray`` -> the Ray session's log folder on this node; None when there is none
        here (a Ray client connection)."""
        try:
            import ray

            node = ray._private.worker._global_node
        except Exception:  # noqa: BLE001 - Ray's private layout moved: nothing to link
            return None
        if node is None:  # a Ray client connection: no local node
            return None
        session_logs = Path(node.get_logs_dir_path())
        link = self.log_dir / "ray"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(session_logs, target_is_directory=True)
        return session_logs

    def close(self) -> None:
        root = logging.getLogger()
        for handler in self.handlers:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(self.root_level)
        for handler in self.root_handlers:
            root.addHandler(handler)
        ray_logger = logging.getLogger("ray")
        for handler in self.ray_handlers:
            ray_logger.addHandler(handler)
        ray_logger.propagate = self.ray_propagate
        for name, previous in self.quiet_levels.items():
            logging.getLogger(name).setLevel(previous)
        logging.captureWarnings(False)


def keep_ray_colours_off_files() -> None:
    """Ray wraps the ``(raylet)`` and ``(Worker pid=...)`` prefixes of the lines it forwards
    to the driver (a worker's death among them) in colour codes unless RAY_COLOR_PREFIX=0;
    off a terminal they would reach the log file or pipe as text. Ray reads the variable as
    it prints, in the driver."""
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def route_driver_logs(run_dir: Path, level: str) -> DriverLogs:
    """Send the driver's logging to ``<run_dir>/logs/driver.log`` and, above ``level``, to
    the console. Call before Ray starts, so Ray's start-up lines are routed as well (Ray is
    then initialised with ``configure_logging=False``)."""
    keep_ray_colours_off_files()
    log_dir = (run_dir / "logs").resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    routing = DriverLogs(log_dir, level, root_level=root.level)
    file_handler = DriverLogFile(log_dir / "driver.log")
    file_handler.setLevel(logging.DEBUG if level == "debug" else logging.INFO)
    file_handler.setFormatter(logging.Formatter(FILE_FORMAT))
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(level_number(level))
    console.setFormatter(logging.Formatter(CONSOLE_FORMAT))
    console.addFilter(ConsoleFilter())
    routing.handlers = [file_handler, console]
    # Handlers set up before (Hydra's job logging prints INFO to stdout) would bypass the
    # console threshold; they are put back by close().
    routing.root_handlers = list(root.handlers)
    for handler in routing.root_handlers:
        root.removeHandler(handler)
    for handler in routing.handlers:
        root.addHandler(handler)
    root.setLevel(min(file_handler.level, console.level))
    # Ray's driver logger writes straight to stderr and does not propagate; hand its
    # records to the handlers above instead.
    ray_logger = logging.getLogger("ray")
    routing.ray_handlers, routing.ray_propagate = list(ray_logger.handlers), ray_logger.propagate
    for handler in routing.ray_handlers:
        ray_logger.removeHandler(handler)
    ray_logger.propagate = True
    logging.captureWarnings(True)
    # One INFO line per HTTP call of the agents' OpenAI clients (thousands a step) would
    # bury the rest; their warnings and errors still come through.
    for name in QUIET_LOGGERS:
        quiet = logging.getLogger(name)
        routing.quiet_levels[name] = quiet.level
        quiet.setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
    return routing


def route_worker_logs(role: str, rank: int) -> Path | None:
    """In a worker process started for a run: point stdout and stderr (the file descriptors,
    so C libraries follow) at ``<log dir>/<role>_rank<rank>.log``, and keep a console
    handler on the original stderr, which Ray forwards to the driver, for the ``rlframe``
    and ``workers`` loggers above the run's level and for errors from anywhere. Does
    nothing outside a run (no ``RLFRAME_LOG_DIR``), so the class also runs standalone."""
    log_dir = os.environ.get(LOG_DIR_ENV)
    if not log_dir:
        return None
    level = os.environ.get(LOG_LEVEL_ENV, "warning")
    path = Path(log_dir) / f"{role}_rank{rank}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    console_fd = os.dup(2)
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    console = logging.StreamHandler(os.fdopen(console_fd, "w", buffering=1))
    console.setFormatter(logging.Formatter(f"{role} rank {rank}: {CONSOLE_FORMAT}"))
    console.addFilter(ConsoleFilter())
    console.setLevel(level_number(level))
    for name in ("rlframe", "workers"):
        logger = logging.getLogger(name)
        logger.addHandler(console)
        logger.setLevel(min(logger.level or logging.WARNING, level_number(level)))
        # Records reach the root's handlers (stderr, now the file) as well.
    errors = logging.StreamHandler(os.fdopen(os.dup(console_fd), "w", buffering=1))
    errors.setFormatter(console.formatter)
    errors.setLevel(logging.ERROR)
    errors.addFilter(lambda record: not record.name.startswith(("rlframe", "workers")))
    logging.getLogger().addHandler(errors)
    return path


def format_startup_summary(lines: dict[str, str]) -> str:
    """``rlframe: key  value`` lines, keys aligned."""
    width = max(len(k) for k in lines)
    return "\n".join(f"rlframe: {k.ljust(width)}  {v}" for k, v in lines.items())


def describe_run(
    cfg: Config, model_path: str, device: str, run_dir: Path, logs: DriverLogs, cluster: str
) -> dict[str, str]:
    """The start-up summary: model, world, devices, Ray (``cluster``, as
    :func:`rlframe.controller.cluster.describe_cluster` words it), and where the run writes."""
    model = cfg.model.path if model_path == cfg.model.path else f"{cfg.model.path} ({model_path})"
    ray_logs = logs.link_ray_logs()
    log_files = "driver.log, <role>_rank<r>.log" + (
        ", ray/ (Ray's session logs)" if ray_logs else ""
    )
    return {
        "model": model,
        **describe_pools(cfg, device),
        "ray": cluster,
        "run dir": str(run_dir.resolve()),
        "logs": f"{logs.log_dir}/ ({log_files})",
    }


def describe_pools(cfg: Config, device: str) -> dict[str, str]:
    """``world`` (ranks, and what they hold) and ``devices`` (their bundles) for the trainer
    pool, and ``rollout world`` / ``rollout devices`` for a separate rollout pool."""
    from rlframe.config.placement import list_pools

    tp, engine = cfg.rollout.tensor_parallel_size, cfg.rollout.engine.value
    pools = list_pools(cfg.rollout, cfg.trainer)
    lines: dict[str, str] = {}
    for pool in pools:
        if len(pools) == 1:
            holds = "training + rollout (colocated)"
        else:
            holds = "training" if pool.section == "trainer" else "rollout (separate)"
        if pool is pools[-1]:  # the pool that holds the engines
            holds += f"; {pool.world_size // tp} {engine} engine(s) of tensor-parallel size {tp}"
        prefix = "" if pool.section == "trainer" else "rollout "
        lines[f"{prefix}world"] = (
            f"{pool.world_size} rank(s) = {pool.nnodes} node(s) x {pool.procs_per_node}, {holds}"
        )
        if pool.section == "trainer":
            lines["mesh"] = describe_mesh(cfg, pool.world_size)
        per_rank = f"{pool.cpus_per_proc} CPU(s)"
        if device == "cuda":
            per_rank = f"1 GPU + {per_rank}"
        lines[f"{prefix}devices"] = f"{device}, {per_rank} per rank"
    return lines


def describe_mesh(cfg: Config, world_size: int) -> str:
    """The training ranks as data x sequence groups (``actor.sequence_parallel_size``)."""
    sp = cfg.actor.sequence_parallel_size
    text = f"{world_size // sp} data x {sp} sequence (training)"
    ep = cfg.actor.expert_parallel_size
    if ep > 1:
        text += f"; experts {world_size // ep} replica x {ep} expert"
    if cfg.critic.enable and cfg.critic.sequence_parallel_size != sp:
        critic_sp = cfg.critic.sequence_parallel_size
        text += f"; critic {world_size // critic_sp} data x {critic_sp} sequence"
    critic_ep = cfg.critic.expert_parallel_size
    if cfg.critic.enable and critic_ep > 1:
        text += f"; critic experts {world_size // critic_ep} replica x {critic_ep} expert"
    return text
