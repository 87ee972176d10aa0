"""Run untrusted Python (a policy's answer) in a sandbox that holds against hostile code.

The boundary is bubblewrap (``bwrap``, Debian's ``bubblewrap`` package). Every run gets:

- a minimal root file system: ``/usr`` and the interpreter's own prefix read-only (its
  ``site-packages`` masked by an empty folder), ``/proc`` of its own PID namespace, a minimal
  ``/dev``, and three size-limited tmpfs: its working folder ``/sandbox`` (also ``HOME``),
  ``/tmp`` and ``/dev/shm``. Nothing else of the host exists in it: no ``/root``, ``/home``,
  ``/etc``, ``/work``, run directories, ``/tmp/ray`` or host ``/dev/shm`` segments, so no
  host Unix socket can be reached by path either;
- empty network, IPC, UTS and PID namespaces (only a loopback interface of its own; no
  abstract Unix socket of the host; other processes invisible; everything dies with the
  sandbox);
- no new user namespaces (:mod:`.sandbox_seccomp`: a seccomp filter refuses
  ``unshare``/``clone`` with ``CLONE_NEWUSER``, ``setns`` and ``clone3``), so the program
  cannot give itself capabilities in a namespace of its own; nor the kernel keyring (the
  same filter refuses ``add_key``, ``request_key``, ``keyctl``), which every sandbox's uid
  would otherwise share;
- as root, a switch to the unprivileged host uid/gid 65534 (``setpriv``) with no capabilities,
  no supplementary groups and ``no_new_privs``: permission bits apply even if a path leaks;
- ``python -I -S``: no site-packages at all (no ``ray``, no ``torch``), unless the caller
  lists packages to expose (see :func:`run_python`'s ``packages``);
- limits for the whole sandbox where cgroups are writable (:mod:`.sandbox_cgroups`): memory
  of the process tree, process count, CPU share; and per process rlimits on CPU seconds,
  address space, file size and core dumps; a wall-clock limit after which everything is
  SIGKILLed and the groups removed.

Without bubblewrap, or where it cannot build a sandbox here, :func:`detect_isolation` raises
:class:`SandboxUnavailable` naming the cause: code is never run unsandboxed. The command line
that builds it is :mod:`rlframe.rewards.sandbox_command`'s; this module runs it (cgroups,
deadline, clean-up) and probes once what holds on the machine.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import IO, Any

from rlframe.rewards.sandbox_cgroups import (
    SandboxCgroup,
    available_controllers,
    make_sandbox_cgroup,
    remove_orphaned_cgroups,
)
from rlframe.rewards.sandbox_command import (
    SANDBOX_UID,
    WORK,
    SandboxLimits,
    SandboxUnavailable,
    build_command,
    seccomp_file,
)
from rlframe.rewards.sandbox_seccomp import build_filter

STARTUP_LIMIT_S = 30.0
"""The longest building the sandbox may take (about 50 ms, seconds on a loaded machine). The
program's ``wall_s`` starts when the launcher inside reports ready, so that time is not the
program's, and the limit itself holds at its setting."""


@dataclass(frozen=True)
class Isolation:
    """The protections in force on this machine (probed once by :func:`detect_isolation`)."""

    namespaces: bool
    """File system, network, PID and IPC isolation by bubblewrap (always True: without it
    :func:`detect_isolation` raises)."""
    reason: str
    """bubblewrap's version line."""
    process_cap: str = "pids cgroup"
    """What bounds the number of processes: ``pids cgroup`` or ``RLIMIT_NPROC``."""
    uid: int | None = SANDBOX_UID
    """Host uid of the program, or None when it keeps the caller's (rlframe not run as root)."""
    controllers: tuple[str, ...] = ()
    """cgroup controllers applied per sandbox (memory, pids, cpu)."""

    def describe(self) -> str:
        """The start-up line: what holds, and what does not."""
        who = f"uid {self.uid}" if self.uid is not None else "the caller's uid (not root)"
        memory = (
            "memory per sandbox (cgroup)"
            if "memory" in self.controllers
            else "memory per process only (RLIMIT_AS; no writable memory cgroup)"
        )
        cpu = "cpu quota per sandbox" if "cpu" in self.controllers else "cpu per process only"
        userns = (
            "no new user namespaces (seccomp)"
            if build_filter() is not None
            else "new user namespaces NOT blocked (no seccomp filter for this architecture)"
        )
        return (
            f"rlframe: sandbox: {self.reason}: minimal read-only root, private /sandbox /tmp "
            f"/dev/shm (tmpfs), no network but its own loopback, {who}, {userns}, no "
            f"site-packages; {memory}, processes by {self.process_cap}, {cpu}"
        )


@dataclass
class SandboxResult:
    status: str
    """``ok`` (exit 0), ``error`` (non-zero exit), ``signal`` (killed by a signal: CPU or
    file-size limit, memory cgroup...) or ``timeout`` (ran past ``wall_s``)."""
    exit_code: int | None
    """The exit code (128 + the signal number when a signal killed it); None after a timeout."""
    stdout: str
    stderr: str
    wall_s: float
    isolation: Isolation
    out_of_memory: bool = False
    """The memory cgroup's OOM killer fired."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def pick_nproc(isolation: Isolation, limits: SandboxLimits) -> int:
    """RLIMIT_NPROC for the launcher to set: 0 (none) where a pids cgroup bounds the sandbox.
    Without one, RLIMIT_NPROC counts every process of the sandbox uid (all sandboxes
    together), so it leaves room for the others."""
    return 0 if "pids" in isolation.controllers else limits.processes * 8


class Sandbox:
    """One running sandbox: its process, its cgroups and its deadline. ``close()`` kills
    whatever is left and removes the groups; the tmpfs vanish with the mount namespace."""

    def __init__(
        self,
        files: dict[str, str],
        script: str,
        limits: SandboxLimits,
        stdin: IO[Any] | int,
        stdout: IO[Any] | int,
        stderr: IO[Any] | int,
        packages: Sequence[str] = (),
    ) -> None:
        self.isolation = detect_isolation()
        self.limits = limits
        self.cgroup: SandboxCgroup | None = (
            make_sandbox_cgroup(limits.memory_mb, limits.processes, limits.cpus)
            if self.isolation.controllers
            else None
        )
        nproc = pick_nproc(self.isolation, limits)
        sources = [tempfile.TemporaryFile() for _ in files]
        seccomp = seccomp_file()
        ready, ready_w = os.pipe()
        try:
            for source, text in zip(sources, files.values()):
                source.write(text.encode())
                source.seek(0)
            fds = {name: s.fileno() for name, s in zip(files, sources)}
            seccomp_fd = seccomp.fileno() if seccomp is not None else None
            command = build_command(fds, script, limits, packages, nproc, ready_w, seccomp_fd)
            if self.cgroup is not None:
                # The shell joins the groups, then becomes bwrap: everything it starts stays in.
                join = 'for p in $0; do echo $$ > "$p" || exit 125; done; exec "$@"'
                command = ["/bin/sh", "-c", join, " ".join(self.cgroup.procs_files()), *command]
            self.started = time.monotonic()
            self.proc = subprocess.Popen(
                command,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                pass_fds=(*fds.values(), ready_w, *([seccomp_fd] if seccomp_fd else [])),
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        except BaseException:
            os.close(ready)
            if self.cgroup is not None:
                self.cgroup.remove()
            raise
        finally:
            os.close(ready_w)
            for source in sources:
                source.close()
            if seccomp is not None:
                seccomp.close()
        self.deadline = self.wait_ready(ready) + limits.wall_s

    def wait_ready(self, ready: int) -> float:
        """When the program started: the launcher's ready byte (or the end of the pipe, if the
        sandbox died first). A sandbox that takes STARTUP_LIMIT_S to build gets no time."""
        try:
            found, _, _ = select.select([ready], [], [], STARTUP_LIMIT_S)
            if found:
                os.read(ready, 1)
        finally:
            os.close(ready)
        self.started = time.monotonic()
        return self.started if found else self.started - self.limits.wall_s

    def time_left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def close(self) -> tuple[int | None, bool]:
        """Kill what is left; return (exit code or None if it was still running, OOM seen)."""
        code = self.proc.poll()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        oom = False
        if self.cgroup is not None:
            oom = self.cgroup.oom_killed()
            self.cgroup.remove()
        return code, oom


def run_python(
    code: str,
    stdin: str = "",
    limits: SandboxLimits = SandboxLimits(),
    packages: Sequence[str] = (),
) -> SandboxResult:
    """Run ``code`` as ``/sandbox/main.py`` in a fresh sandbox, feeding it ``stdin``.

    ``packages``: the allow-list of installed top-level packages the program may import
    (mounted read-only under /packages); empty by default, so only the standard library."""
    # Files, not pipes: a program that floods its output is stopped by RLIMIT_FSIZE instead
    # of filling the caller's memory, and nothing can deadlock on a full pipe.
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.TemporaryFile() as inp,
    ):
        inp.write(stdin.encode())
        inp.seek(0)
        box = Sandbox({"main.py": code}, f"{WORK}/main.py", limits, inp, out, err, packages)
        try:
            box.proc.wait(timeout=box.time_left())
        except subprocess.TimeoutExpired:
            pass
        finally:
            exit_code, oom = box.close()
        wall = time.monotonic() - box.started
        stdout, stderr = read_capped(out), read_capped(err)
    return SandboxResult(classify(exit_code), exit_code, stdout, stderr, wall, box.isolation, oom)


@cache
def detect_isolation() -> Isolation:
    """Probe once that bubblewrap builds a sandbox here; say which protections hold.
    Raises SandboxUnavailable (with the cause and the fix) when it cannot."""
    if shutil.which("bwrap") is None:
        raise SandboxUnavailable(
            "the sandbox for untrusted code needs bubblewrap: apt-get install bubblewrap "
            "(no bwrap on PATH)"
        )
    version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout
    remove_orphaned_cgroups()
    controllers = tuple(sorted(available_controllers()))
    as_root = os.geteuid() == 0
    if as_root and shutil.which("setpriv") is None:
        raise SandboxUnavailable("the sandbox needs setpriv (util-linux) to drop root")
    isolation = Isolation(
        True,
        version.strip() or "bubblewrap",
        "pids cgroup" if "pids" in controllers else "RLIMIT_NPROC",
        SANDBOX_UID if as_root else None,
        controllers,
    )
    probe = probe_sandbox(isolation)
    if probe:
        raise SandboxUnavailable(f"bubblewrap cannot build the sandbox here: {probe}")
    return isolation


def probe_sandbox(isolation: Isolation) -> str:
    """Run ``print(uid)`` in a sandbox by hand (detect_isolation is not cached yet): the
    error text, or empty when it worked."""
    limits = SandboxLimits()
    seccomp = seccomp_file()
    with tempfile.TemporaryFile() as source:
        source.write(b"import os\nprint(os.getuid())\n")
        source.seek(0)
        nproc = pick_nproc(isolation, limits)
        seccomp_fd = seccomp.fileno() if seccomp is not None else None
        files = {"main.py": source.fileno()}
        command = build_command(files, f"{WORK}/main.py", limits, (), nproc, None, seccomp_fd)
        passed = (source.fileno(), *([seccomp_fd] if seccomp_fd is not None else []))
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=30, pass_fds=passed
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return str(e)
        finally:
            if seccomp is not None:
                seccomp.close()
    expected = str(SANDBOX_UID) if isolation.uid is not None else None
    if done.returncode != 0 or (expected is not None and done.stdout.strip() != expected):
        return (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    return ""


def find_prctl() -> Callable[..., int] | None:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Resolved here, not in the forked child, which should do as little as possible.
PRCTL = find_prctl()


def die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started it dies. A reward
    worker killed for running past reward.timeout_s must not leave its sandbox running."""
    if PRCTL is not None:
        PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def read_capped(file: IO[bytes], limit: int = 1 << 20) -> str:
    file.seek(0)
    return file.read(limit).decode(errors="replace")


def classify(exit_code: int | None) -> str:
    if exit_code is None:
        return "timeout"
    if exit_code == 0:
        return "ok"
    # bwrap reports a fatal signal as 128 + its number, as shells do.
    return "signal" if exit_code > 128 or exit_code < 0 else "error"
