"""Starting or joining Ray, and resolving ``trainer.device=auto`` against the cluster.

A Ray that rlframe starts itself is a private, single-machine cluster: it lives on the
loopback interface and dies with its driver. This module imports Ray lazily so that it can
set Ray's environment before Ray is first imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from rlframe.config import Device, RayConfig
from rlframe.config.device import will_start_local_ray

# Read by ray._private.ray_constants at import (and patched below when Ray is already
# imported). Off, Ray takes 127.0.0.1 as this machine's address instead of asking the
# network which interface reaches the outside.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK = "127.0.0.1"

SYSTEM_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
"""A local Ray's settings. Ray starts one idle worker process per CPU when its raylet starts
and again when the driver connects. Every rlframe actor has a runtime environment of its own
(its rank's variables), so none of them ever runs in one, and on a small machine their
start-up took CPU from the workers'."""


def prepare_ray_environment(cfg: RayConfig) -> bool:
    """Set Ray's environment before Ray is imported; True when this run starts a local Ray."""
    local = will_start_local_ray(cfg)
    if local:
        os.environ[LOOPBACK_ENV] = "0"
    return local


def init_ray(cfg: RayConfig) -> bool:
    """Join the cluster ``cfg.address`` (or RAY_ADDRESS) names, else start a local one.

    A locally started Ray is bound to 127.0.0.1: its node address (so the GCS, the raylet,
    the object manager and every worker's gRPC server listen on loopback only), the
    dashboard (when ``ray.include_dashboard``) and the workers' rendezvous. A reaper process
    stops it if the driver dies without shutting it down (SIGKILL). Ray's driver logging is
    left to the handlers :func:`rlframe.observability.logs.route_driver_logs` installed.
    Returns True when this call started a local Ray, which the caller then shuts down.
    """
    local = prepare_ray_environment(cfg)
    import ray

    if ray.is_initialized():
        return False
    if not local:
        ray.init(
            address=cfg.address or os.environ["RAY_ADDRESS"],
            log_to_driver=True,
            configure_logging=False,
        )
        return False
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(
        address="local",
        num_cpus=cfg.num_cpus,
        include_dashboard=cfg.include_dashboard,
        dashboard_host=LOOPBACK,
        _node_ip_address=LOOPBACK,
        _system_config=SYSTEM_CONFIG,
        log_to_driver=True,
        configure_logging=False,
    )
    start_reaper()
    return True


class RayStart:
    """:func:`init_ray` on a thread of its own, so that the run's checks go on while Ray's
    processes start (most of that time the driver only waits for them).

    The thread lives until :meth:`stop`: Ray ties the processes it starts to the life of the
    thread that started them (``PR_SET_PDEATHSIG``), so they would be killed with it (a stop
    during the start kills them itself, :meth:`abandon`). The
    modules ``ray.init`` imports are imported first, on the calling thread: two threads
    importing one package at once can see it half initialised (or deadlock), and the checks
    import users' plug-in files, which may share a package with Ray.
    """

    def __init__(self, cfg: RayConfig) -> None:
        import_ray(cfg)
        self.local = will_start_local_ray(cfg)
        """This start starts a local Ray (rather than joining a cluster)."""
        self.began = time.time()
        self.seconds = 0.0
        """How long the start took, once it ended."""
        self.started = False
        """This call started a local Ray (which :meth:`stop` shuts down)."""
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.release = threading.Event()
        self.thread = threading.Thread(
            target=self.run, args=(cfg,), name="rlframe-ray-start", daemon=True
        )
        self.thread.start()

    def run(self, cfg: RayConfig) -> None:
        try:
            self.started = init_ray(cfg)
        except BaseException as e:  # noqa: BLE001 - raised again on the main thread by wait()
            self.error = e
        finally:
            self.seconds = time.time() - self.began
            self.ready.set()
        self.release.wait()

    def wait(self) -> bool:
        """Wait until Ray is up (the start's error is raised here); True when this run started
        it. A signal still ends the wait: the main thread's handlers run during it."""
        self.ready.wait()
        if self.error is not None:
            raise self.error
        return self.started

    def stop(self) -> None:
        """Shut down the Ray this run started and end the thread. A stop that comes while Ray
        is still starting (a check failed meanwhile, or a signal came) does not wait seconds
        for the start to end before it shuts Ray down: it abandons the start
        (:meth:`abandon`)."""
        if not self.ready.is_set():
            self.abandon()
            return
        if self.started:
            import ray

            ray.shutdown()
        self.release.set()
        self.thread.join()

    def abandon(self) -> None:
        """Kill the processes a local start has begun so far; without its GCS the start soon
        fails. They are looked for once more after a short wait: one begun in between is
        killed too, and one begun later still dies with this process, which ends next (Ray
        ties the processes it starts to the starting thread's life). Joining a cluster starts
        no process here: that start is left to end with this process."""
        if self.local:
            kill_ray_processes()
            if not self.ready.wait(ABANDON_WAIT_S):
                kill_ray_processes()
        self.release.set()


ABANDON_WAIT_S = 0.5
"""How long an abandoned start is given to fail before its processes are looked for again."""


def kill_ray_processes() -> None:
    """SIGKILL this process's descendants that are Ray's (:func:`is_ray_process`)."""
    import psutil
    import ray

    package = os.path.dirname(ray.__file__)
    for child in psutil.Process().children(recursive=True):
        try:
            if is_ray_process(child.cmdline(), package):
                child.kill()
        except psutil.Error:  # gone meanwhile
            continue


def is_ray_process(cmdline: list[str], package: str) -> bool:
    """A process of Ray's: one of its binaries or scripts (GCS, raylet, dashboard, monitors,
    all under Ray's ``package`` folder) or an agent or worker that names itself ``ray::``."""
    named = bool(cmdline) and cmdline[0].startswith("ray::")
    return named or any(package in part for part in cmdline)


def import_ray(cfg: RayConfig) -> None:
    """Set Ray's environment, then import what ``ray.init`` imports (Ray, and the dashboard's
    packages it checks for). Importing Ray sets up its loggers (a handler straight to stderr):
    :func:`rlframe.observability.logs.route_driver_logs` takes them over, so it comes after."""
    prepare_ray_environment(cfg)
    import ctypes  # noqa: F401
    import gzip  # noqa: F401

    import ray  # noqa: F401
    from ray._private.utils import get_dashboard_dependency_error

    get_dashboard_dependency_error()


def start_reaper() -> subprocess.Popen[bytes]:
    """Start :mod:`rlframe.controller.reaper` for the local cluster this process started.

    Ray's GCS and raylet follow their driver down, but its dashboard and runtime-env agents
    were seen alive 80 s after a SIGKILL of the driver. The reaper runs in its own session
    (a kill of the driver's process group does not reach it) and holds none of the
    driver's pipes, so whoever reads the driver's output still sees it end.
    """
    import ray

    node = ray._private.worker._global_node
    if node is None:
        raise RuntimeError("start_reaper runs after ray.init started a local cluster")
    roots = [
        str(info.process.pid)
        for infos in node.all_processes.values()
        for info in infos
        if info.process
    ]
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlframe.controller.reaper",
            str(os.getpid()),
            node.get_session_dir_path(),
            *roots,
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def describe_cluster(started_here: bool) -> str:
    """One line for the start-up summary: which Ray, where."""
    import ray

    context = ray.get_runtime_context()
    resources = ray.cluster_resources()
    nodes = sum(1 for n in ray.nodes() if n["Alive"])
    total = f"{nodes} node(s), {resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs"
    if started_here:
        return f"local Ray started here on {LOOPBACK} ({total}); stopped when this run ends"
    return f"joined {context.gcs_address} ({total}); left running"


def resolve_device(requested: Device) -> str:
    """``cuda`` or ``cpu``; ``auto`` asks the cluster, never this process's own GPU."""
    import ray

    if requested is Device.auto:
        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    return str(requested.value)
