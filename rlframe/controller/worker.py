"""The base class of every worker that a WorkerGroup starts.

A worker learns its place from the environment the group set (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` or ``RLFRAME_RENDEZVOUS_FILE``), so the same class runs under
Ray, under torchrun or in a plain process for debugging.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from rlframe.controller.dispatch import Dispatch, dispatch
from rlframe.observability.logs import route_worker_logs
from rlframe.observability.startup import StartupClock

RENDEZVOUS_FILE_ENV = "RLFRAME_RENDEZVOUS_FILE"


def find_loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS), if there is one."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), None)


class Worker:
    """Rank bookkeeping and the process group; roles subclass it and add ``@dispatch`` methods."""

    def __init__(self) -> None:
        # From the process start: Python, Ray's worker set-up and this class's imports.
        self.startup = StartupClock()
        self.startup.mark("boot")
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.role = os.environ.get("RLFRAME_ROLE", type(self).__name__)
        # Before any engine starts: its output belongs in the run's logs/, not the console.
        self.log_path = route_worker_logs(self.role, self.rank)

    @dispatch(Dispatch.RANK_ZERO)
    def report_startup(self) -> dict[str, float]:
        """Rank 0's start-up phases (seconds): ``boot`` then those its class marked."""
        return dict(self.startup.phases)

    def init_process_group(self, device: str, timeout_s: float = 1800.0) -> None:
        """Join the group's default process group: nccl on cuda, gloo on cpu.

        A group on one node rendezvouses through a file (``RLFRAME_RENDEZVOUS_FILE``), not
        through torch's TCP store, whose server listens on every interface; gloo is then
        told to use the loopback interface. A group spanning nodes uses ``MASTER_ADDR``
        (rank 0's node) and ``MASTER_PORT``.
        """
        if dist.is_initialized():
            return
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(self.local_rank)
        rendezvous_file = os.environ.get(RENDEZVOUS_FILE_ENV)
        init_method = f"file://{rendezvous_file}" if rendezvous_file else "env://"
        if rendezvous_file and (loopback := find_loopback_interface()):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
