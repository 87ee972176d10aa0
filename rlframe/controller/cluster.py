"""Starting or joining Ray, and resolving ``trainer.device=auto`` against the cluster.

This module imports Ray lazily: :func:`init_ray` must be able to set Ray's environment
before Ray is first imported.
"""

from __future__ import annotations

import os
import sys

from rlframe.config import Device, RayConfig

# Read once by ray._private.ray_constants at import. Off, a node's address is loopback.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def will_start_local_ray(cfg: RayConfig) -> bool:
    return not (cfg.address or os.environ.get("RAY_ADDRESS"))


def init_ray(cfg: RayConfig) -> bool:
    """Join the cluster ``cfg.address`` (or RAY_ADDRESS) names, else start a local one.

    A locally started Ray lives on loopback only: its node address, the dashboard (when
    ``ray.include_dashboard``) and the workers' rendezvous all use 127.0.0.1, so nothing
    listens on or talks to the machine's network interfaces. Returns True when this call
    started a local Ray, which the caller then shuts down.
    """
    local = will_start_local_ray(cfg)
    if local and "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_ENV, "0")
    import ray

    if ray.is_initialized():
        return False
    if not local:
        ray.init(address=cfg.address or os.environ["RAY_ADDRESS"], log_to_driver=True)
        return False
    ray.init(
        address="local",
        num_cpus=cfg.num_cpus,
        include_dashboard=cfg.include_dashboard,
        dashboard_host="127.0.0.1",
        log_to_driver=True,
    )
    return True


def resolve_device(requested: Device) -> str:
    """``cuda`` or ``cpu``; ``auto`` asks the cluster, never this process's own GPU."""
    import ray

    if requested is Device.auto:
        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    return requested.value
