"""Run untrusted Python (a policy's answer) in a subprocess that cannot hurt the machine.

Every run gets:

- a wall-clock limit, after which the whole process group is SIGKILLed;
- rlimits: CPU seconds, address space, size of any file written, number of processes, no
  core dumps;
- a private temporary folder as working directory, ``HOME`` and ``TMPDIR``, removed after;
- a scrubbed environment (``PATH``, ``HOME``, ``TMPDIR``, ``LANG`` only) and ``python -I``.

Where the kernel lets an unprivileged user create namespaces (checked once, by
:func:`detect_isolation`), the run also gets, through ``unshare``:

- a network namespace with no interfaces up: no connection leaves, not even to loopback;
- a PID namespace: other processes (and their ``/proc/<pid>/environ``) are invisible, and
  when the sandbox's first process dies the kernel kills every process left in it;
- a mount namespace whose whole file system is read-only except the private folder, and a
  second, unmapped user namespace so the code cannot make it writable again. RLIMIT_NPROC
  then counts the sandbox's own processes only.

Without namespaces the rlimits, the process-group kill and the private folder still
apply, but the network and the file system are *not* isolated: :func:`detect_isolation`
says so, and :func:`warn_if_not_isolated` prints it once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

# Runs first inside the sandbox, as ``python -I -c LAUNCHER DIR LIMITS_JSON ISOLATED``: it
# locks the file system down (when isolated), sets the rlimits and execs the program. It
# imports nothing from rlframe: the environment it sees is scrubbed.
LAUNCHER = r"""
import ctypes, json, os, resource, sys

work, limits, isolated = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1"
libc = ctypes.CDLL(None, use_errno=True)

class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

def set_mount_readonly(path, readonly):
    attr = MountAttr(1, 0, 0, 0) if readonly else MountAttr(0, 1, 0, 0)
    # mount_setattr(AT_FDCWD, path, AT_RECURSIVE, attr): x86_64 and aarch64 both use 442.
    if libc.syscall(442, -100, path.encode(), 0x8000, ctypes.byref(attr), ctypes.sizeof(attr)) != 0:
        raise OSError(ctypes.get_errno(), "mount_setattr " + path)

if isolated:
    if libc.mount(work.encode(), work.encode(), None, 4096 | 16384, None) != 0:  # MS_BIND | MS_REC
        raise OSError(ctypes.get_errno(), "bind mount of the sandbox folder")
    set_mount_readonly("/", True)
    set_mount_readonly(work, False)
    # A second user namespace without a uid map: no capability over the mounts above, so
    # the code cannot make the file system writable again.
    if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")
    nproc = limits["processes"]
else:
    # RLIMIT_NPROC counts every process of this user: allow the ones running now plus ours.
    uid = os.getuid()
    mine = 0
    for pid in os.listdir("/proc"):
        try:
            mine += pid.isdigit() and os.stat("/proc/" + pid).st_uid == uid
        except OSError:
            pass
    nproc = mine + limits["processes"]

# The program runs in a child: as the PID namespace's first process it would ignore
# signals it has no handler for (SIGXCPU among them). Its fate comes back as an exit code,
# 128 + signal number when a signal killed it, as shells report it.
child = os.fork()
if child == 0:
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb, limits["memory_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_mb"] * mb, limits["file_size_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.chdir(work)
    os.execv(sys.executable, [sys.executable, "-I", "main.py"])
_, status = os.waitpid(child, 0)
sys.exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
"""

UNSHARE = [
    "unshare",
    "--user",
    "--map-root-user",
    "--net",
    "--pid",
    "--fork",
    "--kill-child",
    "--mount",
    "--mount-proc",
]


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    """Wall-clock seconds before the run is killed."""
    cpu_s: int = 10
    """CPU seconds (RLIMIT_CPU): SIGXCPU, then SIGKILL a second later."""
    memory_mb: int = 1024
    """Address space of each process (RLIMIT_AS)."""
    file_size_mb: int = 16
    """Largest file any process may write (RLIMIT_FSIZE); stdout and stderr count too."""
    processes: int = 16
    """Processes the program may have at once (RLIMIT_NPROC)."""


@dataclass(frozen=True)
class Isolation:
    """What the kernel allows here; the rlimits, timeout and private folder always apply."""

    namespaces: bool
    """Network, PID and read-only mount namespaces are in force."""
    reason: str
    """Why not, when they are not (the probe's error)."""
    process_cap: str = "RLIMIT_NPROC"
    """What bounds the number of processes: ``RLIMIT_NPROC`` (any user but root, whom the
    kernel exempts), ``pids cgroup`` (root with a writable pids controller) or ``none``."""

    @property
    def network_isolated(self) -> bool:
        return self.namespaces

    @property
    def filesystem_isolated(self) -> bool:
        return self.namespaces


@dataclass
class SandboxResult:
    status: str
    """``ok`` (exit 0), ``error`` (non-zero exit), ``signal`` (killed by a signal: CPU or
    file-size limit...) or ``timeout`` (ran past ``wall_s``)."""
    exit_code: int | None
    """The exit code (128 + the signal number when a signal killed it); None after a timeout."""
    stdout: str
    stderr: str
    wall_s: float
    isolation: Isolation

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def find_pids_cgroup_root() -> Path | None:
    """Where a child pids cgroup can be made: cgroup v1's pids hierarchy, or the v2 root
    when it delegates the pids controller; None if neither is writable."""
    v1, v2 = Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")
    if (v1 / "cgroup.procs").exists() and os.access(v1, os.W_OK):
        return v1
    control = v2 / "cgroup.subtree_control"
    if control.exists() and "pids" in control.read_text().split() and os.access(v2, os.W_OK):
        return v2
    return None


def detect_process_cap() -> str:
    if os.geteuid() != 0:
        return "RLIMIT_NPROC"
    return "pids cgroup" if find_pids_cgroup_root() is not None else "none"


@cache
def detect_isolation() -> Isolation:
    """Probe once whether ``unshare`` can give this user the namespaces the sandbox uses,
    and what can bound the number of processes."""
    cap = detect_process_cap()
    if shutil.which("unshare") is None:
        return Isolation(False, "no unshare binary (util-linux)", cap)
    with tempfile.TemporaryDirectory(prefix="rlframe-probe-") as work:
        probe = [
            *UNSHARE,
            sys.executable,
            "-I",
            "-c",
            LAUNCHER,
            work,
            json.dumps(asdict(SandboxLimits())),
            "1",
        ]
        Path(work, "main.py").write_text("print('ok')\n")
        try:
            done = subprocess.run(
                probe, capture_output=True, text=True, timeout=30, cwd=work, env=scrubbed_env(work)
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return Isolation(False, f"unshare probe failed: {e}", cap)
    if done.returncode != 0 or done.stdout.strip() != "ok":
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return Isolation(False, f"unshare refused: {last}", cap)
    return Isolation(True, "", cap)


def warn_if_not_isolated() -> Isolation:
    """Say on stderr, once per process, when code runs without network/file-system isolation."""
    isolation = detect_isolation()
    if getattr(warn_if_not_isolated, "warned", False):
        return isolation
    warn_if_not_isolated.warned = True  # type: ignore[attr-defined]
    if not isolation.namespaces:
        print(
            f"rlframe: sandbox: namespaces unavailable ({isolation.reason}); untrusted code runs with "
            "rlimits, a time limit and a private folder only: the network and the file system are NOT isolated",
            file=sys.stderr,
        )
    if isolation.process_cap == "none":
        print(
            "rlframe: sandbox: running as root without a writable pids cgroup: the number of processes "
            "untrusted code starts is NOT bounded (the kernel exempts root from RLIMIT_NPROC)",
            file=sys.stderr,
        )
    return isolation


def scrubbed_env(work: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": work,
        "TMPDIR": work,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def run_python(
    code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh sandbox, feeding it ``stdin``."""
    isolation = detect_isolation()
    work = tempfile.mkdtemp(prefix="rlframe-sandbox-")
    try:
        Path(work, "main.py").write_text(code)
        launch = [
            sys.executable,
            "-I",
            "-c",
            LAUNCHER,
            work,
            json.dumps(asdict(limits)),
            "1" if isolation.namespaces else "0",
        ]
        command = [*UNSHARE, *launch] if isolation.namespaces else launch
        cgroup = (
            make_pids_cgroup(limits.processes) if isolation.process_cap == "pids cgroup" else None
        )
        if cgroup is not None:
            # The shell joins the cgroup, then becomes the sandbox: everything it starts stays in.
            command = [
                "/bin/sh",
                "-c",
                'echo $$ > "$0" && exec "$@"',
                str(cgroup / "cgroup.procs"),
                *command,
            ]
        # Files, not pipes: a program that floods its output is stopped by RLIMIT_FSIZE
        # instead of filling the driver's memory, and nothing can deadlock on a full pipe.
        with (
            tempfile.TemporaryFile() as out,
            tempfile.TemporaryFile() as err,
            tempfile.TemporaryFile() as inp,
        ):
            inp.write(stdin.encode())
            inp.seek(0)
            start = time.monotonic()
            proc = subprocess.Popen(
                command,
                stdin=inp,
                stdout=out,
                stderr=err,
                cwd=work,
                env=scrubbed_env(work),
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
            try:
                code_or_none: int | None = proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                code_or_none = None
            kill_group(proc)
            if cgroup is not None:
                remove_pids_cgroup(cgroup)
            wall = time.monotonic() - start
            stdout, stderr = read_capped(out), read_capped(err)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return SandboxResult(classify(code_or_none), code_or_none, stdout, stderr, wall, isolation)


def find_prctl() -> object | None:
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


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the run's process group (with namespaces, the PID namespace dies with it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def make_pids_cgroup(processes: int) -> Path | None:
    """A fresh pids cgroup allowing the program's processes plus the two that launch it."""
    root = find_pids_cgroup_root()
    if root is None:
        return None
    remove_stale_cgroups(root)
    group = Path(tempfile.mkdtemp(prefix="rlframe-sandbox-", dir=root))
    (group / "pids.max").write_text(str(processes + 2))  # unshare and the launcher
    return group


def remove_stale_cgroups(root: Path, age_s: float = 60.0) -> None:
    """Remove sandbox cgroups left by killed reward workers. rmdir refuses a cgroup that still
    holds processes, and a minute is far longer than joining a new one takes."""
    now = time.time()
    for group in root.glob("rlframe-sandbox-*"):
        try:
            if now - group.stat().st_mtime > age_s:
                group.rmdir()
        except OSError:
            pass


def remove_pids_cgroup(group: Path) -> None:
    """SIGKILL whatever is left in the cgroup (escapees of the process group), then remove it."""
    for _ in range(100):
        pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
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


def read_capped(file: object, limit: int = 1 << 20) -> str:
    file.seek(0)  # type: ignore[attr-defined]
    return file.read(limit).decode(errors="replace")  # type: ignore[attr-defined]


def classify(exit_code: int | None) -> str:
    if exit_code is None:
        return "timeout"
    if exit_code == 0:
        return "ok"
    # The launcher reports a fatal signal as 128 + its number, as shells do.
    return "signal" if exit_code > 128 or exit_code < 0 else "error"
