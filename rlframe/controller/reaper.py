"""Stops a local Ray cluster whose driver died without shutting it down.

``python -m rlframe.controller.reaper DRIVER_PID SESSION_DIR ROOT_PID ...``, started by
:func:`rlframe.controller.cluster.start_reaper`. While the driver lives, it records every
process descended from the cluster's own processes (GCS, raylet, dashboard, log monitor):
the agents and workers the raylet starts are re-parented once the raylet dies, so they
must be known beforehand. When the driver is gone, it terminates whatever of those is
still alive, plus any process whose command line names the session directory, then exits.
After a clean shutdown it finds nothing left and exits as well.
"""

from __future__ import annotations

import sys
import time

import psutil

POLL_S = 1.0
GRACE_S = 3.0


def is_alive(process: psutil.Process) -> bool:
    try:
        return bool(process.is_running() and process.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def find_descendants(roots: list[psutil.Process]) -> list[psutil.Process]:
    found = []
    for root in roots:
        try:
            found += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return found


def find_session_processes(session_dir: str) -> list[psutil.Process]:
    """Processes whose command line names the session (agents started with --session-dir)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info.get("cmdline") or []
        if any(session_dir in part for part in cmdline):
            found.append(process)
    return found


def stop(processes: list[psutil.Process]) -> None:
    """SIGTERM, then SIGKILL what is still there after the grace period."""
    alive = [p for p in processes if is_alive(p)]
    for process in alive:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, left = psutil.wait_procs(alive, timeout=GRACE_S)
    for process in left:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def watch(driver_pid: int, session_dir: str, root_pids: list[int]) -> None:
    me = psutil.Process()
    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        return
    roots = []
    for pid in root_pids:
        try:
            roots.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    known: dict[tuple[int, float], psutil.Process] = {}
    while is_alive(driver):
        for process in find_descendants(roots):
            try:
                known[(process.pid, process.create_time())] = process
            except psutil.NoSuchProcess:
                continue
        time.sleep(POLL_S)
    left = [p for p in [*known.values(), *find_session_processes(session_dir)] if p.pid != me.pid]
    stop(left)


def main() -> None:
    driver_pid, session_dir, *roots = sys.argv[1:]
    watch(int(driver_pid), session_dir, [int(r) for r in roots])


if __name__ == "__main__":
    main()
