"""What the sandbox says about itself and what it leaves behind: the start-up line, the
reason a probe fails, the output cap, the process limit where a pids cgroup holds, no
file descriptor or cgroup left after a run, even one refused before it starts, and the
sandbox's own hold on its processes (parent-death signal, the whole group killed)."""

from __future__ import annotations

import gc
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from rlframe.rewards import sandbox
from rlframe.rewards.sandbox import (
    Isolation,
    Sandbox,
    detect_isolation,
    pick_nproc,
    probe_sandbox,
    run_python,
)
from rlframe.rewards.sandbox_cgroups import PREFIX
from rlframe.rewards.sandbox_command import SandboxLimits, SandboxUnavailable, interpreter
from tests.unit.sandbox_cgroups import owned_cgroups


def test_the_start_up_line_says_what_holds() -> None:
    full = Isolation(True, "bubblewrap 0.8.0", "pids cgroup", 65534, ("cpu", "memory", "pids"))
    assert full.describe() == (
        "rlframe: sandbox: bubblewrap 0.8.0: minimal read-only root, private /sandbox /tmp "
        "/dev/shm (tmpfs), no network but its own loopback, uid 65534, no new user "
        "namespaces (seccomp), no site-packages; memory per sandbox (cgroup), processes by "
        "pids cgroup, cpu quota per sandbox"
    )
    bare = Isolation(True, "bubblewrap 0.8.0", "RLIMIT_NPROC", None, ())
    assert bare.describe().endswith(
        "the caller's uid (not root), no new user namespaces (seccomp), no site-packages; "
        "memory per process only "
        "(RLIMIT_AS; no writable memory cgroup), processes by RLIMIT_NPROC, cpu per process only"
    )


def test_this_machine_is_described_as_probed() -> None:
    isolation = detect_isolation()
    assert isolation.namespaces and isolation.reason.startswith("bubblewrap ")
    assert isolation.uid == (65534 if os.geteuid() == 0 else None)
    assert isolation.process_cap == (
        "pids cgroup" if "pids" in isolation.controllers else "RLIMIT_NPROC"
    )


def test_a_failed_probe_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    # An interpreter that is not there: bwrap starts, cannot run it, and says so last.
    monkeypatch.setattr(sys, "_base_executable", "/nonexistent/python3")
    reason = probe_sandbox(detect_isolation())
    assert "/nonexistent/python3" in reason and "No such file" in reason


def test_output_is_read_up_to_one_mebibyte() -> None:
    result = run_python("import sys\nsys.stdout.write('x' * (3 << 20))\n")
    assert result.ok and result.stdout == "x" * (1 << 20)


def test_no_process_rlimit_where_a_pids_cgroup_counts_them() -> None:
    """RLIMIT_NPROC counts every process of the sandbox uid, all sandboxes together: set only
    where no pids cgroup bounds each sandbox (then 8 times the limit, room for the others)."""
    result = run_python("import resource\nprint(*resource.getrlimit(resource.RLIMIT_NPROC))")
    assert result.ok, result.stderr
    if "pids" in detect_isolation().controllers:
        expected = resource.getrlimit(resource.RLIMIT_NPROC)
    else:
        expected = (16 * 8, 16 * 8)
    assert tuple(int(n) for n in result.stdout.split()) == expected


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def my_cgroups() -> set[Path]:
    """Sandbox cgroups of this process (other processes may be running sandboxes too)."""
    return {g for g in owned_cgroups() if g.name.startswith(f"{PREFIX}{os.getpid()}-")}


def test_runs_leave_no_descriptor_or_cgroup_behind() -> None:
    """Python warns (ResourceWarning) about a file dropped without being closed."""
    run_python("print(1)")  # caches the probe and anything imported once
    fds = open_fds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for _ in range(3):
            assert run_python("print(input())", stdin="7\n").stdout == "7\n"
        # Refused while building the command: what was opened for it is closed all the same.
        with pytest.raises(SandboxUnavailable, match="no_such_package_here"):
            run_python("print(1)", packages=["no_such_package_here"])
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert open_fds() == fds and my_cgroups() == set()


@pytest.mark.parametrize("controllers,nproc", [(("memory", "pids"), 0), (("memory",), 40)])
def test_rlimit_nproc_only_without_a_pids_cgroup(controllers: tuple[str, ...], nproc: int) -> None:
    isolation = Isolation(True, "bubblewrap", "", 65534, controllers)
    assert pick_nproc(isolation, SandboxLimits(processes=5)) == nproc


FORK_UNTIL_REFUSED = """
import os, time
started = 0
while True:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    started += 1
print(started, flush=True)
"""


def test_sixteen_processes_by_default() -> None:
    if "pids" not in detect_isolation().controllers:
        pytest.skip("no pids cgroup: RLIMIT_NPROC counts the processes of every sandbox")
    # The program and 15 children.
    result = run_python(FORK_UNTIL_REFUSED)
    assert result.ok and result.stdout.split() == ["15"]


def test_folders_above_the_interpreter_cannot_be_listed() -> None:
    """bwrap makes the folders above the interpreter's prefix to mount it: the program may
    pass through them, not list them (as root the program runs as nobody)."""
    prefix = interpreter()[1]
    if prefix.startswith("/usr/") or os.geteuid() != 0:
        pytest.skip("the interpreter is under /usr, or the program keeps the caller's uid")
    parents = [str(p) for p in Path(prefix).parents if str(p) != "/"]
    code = (
        "import os\n"
        f"for folder in {parents!r}:\n"
        "    try:\n"
        "        os.listdir(folder)\n"
        "        print('listed', folder)\n"
        "    except PermissionError:\n"
        "        print('denied', folder)\n"
    )
    result = run_python(code)
    assert result.stdout.splitlines() == [f"denied {p}" for p in parents], result.stderr


def start_plain_sandbox(monkeypatch: pytest.MonkeyPatch, shell: str) -> Sandbox:
    """A Sandbox running ``bash -c shell`` (dash writes to no fd above 9) with no cgroup:
    what the Sandbox itself does to its processes (own session, parent-death signal, group
    kill), without bwrap's --die-with-parent or the cgroup's kill behind it, either of which
    would hide a slip in the Sandbox's own."""
    isolation = replace(detect_isolation(), controllers=())
    monkeypatch.setattr(sandbox, "detect_isolation", lambda: isolation)

    def build_shell_command(*args: object) -> list[str]:
        ready_fd = args[5]  # build_command's (files, script, limits, packages, nproc, ready_fd)
        return ["bash", "-c", f"printf x >&{ready_fd}; {shell}"]

    monkeypatch.setattr(sandbox, "build_command", build_shell_command)
    devnull = subprocess.DEVNULL
    return Sandbox({}, "", SandboxLimits(wall_s=30.0), devnull, subprocess.PIPE, devnull)


def is_running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan may wait a while for its reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_close_kills_the_whole_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child the program left in the background dies with the sandbox's first process."""
    box = start_plain_sandbox(monkeypatch, "sleep 60 & echo $!; wait")
    assert box.proc.stdout is not None
    background = int(box.proc.stdout.readline())
    try:
        assert is_running(background)
        box.close()
        deadline = time.monotonic() + 5.0
        while is_running(background) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not is_running(background)
    finally:
        box.proc.stdout.close()
        if is_running(background):
            os.kill(background, signal.SIGKILL)


def test_the_sandbox_dies_when_what_started_it_dies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Linux sends the parent-death signal when the thread that started a process ends: a
    thread that starts a sandbox and returns stands for a reward worker killed mid-sample."""
    started: list[Sandbox] = []
    starter = threading.Thread(
        target=lambda: started.append(start_plain_sandbox(monkeypatch, "exec sleep 60"))
    )
    starter.start()
    starter.join()
    box = started[0]
    try:
        assert box.proc.wait(timeout=5.0) == -signal.SIGKILL
    finally:
        assert box.proc.stdout is not None
        box.proc.stdout.close()
        box.close()
