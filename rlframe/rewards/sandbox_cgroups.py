"""Per-sandbox control groups: memory, process count and CPU share for a whole process tree.

An rlimit caps each process; a cgroup caps the sandbox: four children of 200 MB each are
four times RLIMIT_AS's worth but one memory cgroup's. Each sandbox gets, in every controller
the machine lets this process write (cgroup v1 hierarchies under ``/sys/fs/cgroup/<name>``,
or the v2 root when it delegates the controller), a group named
``rlframe-sandbox-<owner pid>-<random>``. The owner pid is the process that started the
sandbox (a reward worker), so when that worker is killed its parent can find and remove
what it left (:func:`remove_cgroups_of`).
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PREFIX = "rlframe-sandbox-"
CONTROLLERS = ("memory", "pids", "cpu")
CFS_PERIOD_US = 100_000


def find_controller_root(controller: str) -> Path | None:
    """Where a child group with ``controller`` can be made: its v1 hierarchy, or the v2 root
    when it delegates the controller; None where neither is writable."""
    v1 = CGROUP_ROOT / controller
    if (v1 / "cgroup.procs").exists() and os.access(v1, os.W_OK):
        return v1
    control = CGROUP_ROOT / "cgroup.subtree_control"
    if control.exists() and controller in control.read_text().split():
        if os.access(CGROUP_ROOT, os.W_OK):
            return CGROUP_ROOT
    return None


def available_controllers() -> dict[str, Path]:
    """The controllers this process can use, by name."""
    roots = {c: find_controller_root(c) for c in CONTROLLERS}
    return {c: r for c, r in roots.items() if r is not None}


@dataclass
class SandboxCgroup:
    """The groups of one sandbox, one per usable controller (two may share a v2 group)."""

    groups: dict[str, Path] = field(default_factory=dict)

    def procs_files(self) -> list[str]:
        return sorted({str(g / "cgroup.procs") for g in self.groups.values()})

    def peak_memory_mb(self) -> float | None:
        group = self.groups.get("memory")
        if group is None:
            return None
        for name in ("memory.max_usage_in_bytes", "memory.peak"):
            if (group / name).exists():
                return int((group / name).read_text()) / 2**20
        return None

    def oom_killed(self) -> bool:
        """True when the kernel's OOM killer fired inside this group."""
        group = self.groups.get("memory")
        if group is None:
            return False
        for name, key in (("memory.oom_control", "oom_kill"), ("memory.events", "oom_kill")):
            path = group / name
            if path.exists():
                for line in path.read_text().splitlines():
                    parts = line.split()
                    if len(parts) == 2 and parts[0] == key and int(parts[1]) > 0:
                        return True
        return False

    def remove(self) -> None:
        for group in set(self.groups.values()):
            remove_group(group)


def make_sandbox_cgroup(memory_mb: int, processes: int, cpus: float) -> SandboxCgroup:
    """Fresh groups capping the tree's memory (swap included where accounted), processes
    (the program's plus the three that launch it) and CPU share (``cpus`` cores)."""
    cgroup = SandboxCgroup()
    made: dict[Path, Path] = {}
    for controller, root in available_controllers().items():
        if root not in made:
            made[root] = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root))
        cgroup.groups[controller] = made[root]
    try:
        for controller, group in cgroup.groups.items():
            limit_group(controller, group, memory_mb, processes, cpus)
    except OSError:
        cgroup.remove()
        raise
    return cgroup


def limit_group(controller: str, group: Path, memory_mb: int, processes: int, cpus: float) -> None:
    v2 = group.parent == CGROUP_ROOT and (CGROUP_ROOT / "cgroup.subtree_control").exists()
    if controller == "memory":
        limit = str(memory_mb * 2**20)
        if v2:
            (group / "memory.max").write_text(limit)
            if (group / "memory.swap.max").exists():
                (group / "memory.swap.max").write_text("0")
        else:
            (group / "memory.limit_in_bytes").write_text(limit)
            if (group / "memory.memsw.limit_in_bytes").exists():
                (group / "memory.memsw.limit_in_bytes").write_text(limit)
    elif controller == "pids":
        # The program's processes and bwrap's two (the outer monitor and the namespace's init).
        (group / "pids.max").write_text(str(processes + 2))
    elif controller == "cpu":
        quota = str(max(1000, int(cpus * CFS_PERIOD_US)))
        if v2:
            (group / "cpu.max").write_text(f"{quota} {CFS_PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(quota)


def remove_group(group: Path) -> None:
    """SIGKILL whatever is left in the group (escapees of the process group), then remove it."""
    for _ in range(200):
        try:
            pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
        except OSError:
            return
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    try:
        group.rmdir()
    except OSError:
        pass


def remove_cgroups_of(owner_pid: int) -> None:
    """Remove the groups a (killed) sandbox owner left behind, killing what they hold."""
    for root in set(available_controllers().values()):
        for group in root.glob(f"{PREFIX}{owner_pid}-*"):
            remove_group(group)


def remove_orphaned_cgroups() -> None:
    """Remove groups whose owner process no longer exists (its parent died with it)."""
    for root in set(available_controllers().values()):
        for group in root.glob(f"{PREFIX}*"):
            owner = group.name[len(PREFIX) :].split("-")[0]
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                remove_group(group)
