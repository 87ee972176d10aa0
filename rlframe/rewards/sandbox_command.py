"""The bubblewrap command line of one sandbox (see :mod:`rlframe.rewards.sandbox`): the
minimal read-only root and its masked site-packages, the private tmpfs, the exposed packages,
the drop to an unprivileged uid, and the launcher that sets the per-process limits inside and
runs the program. Building it starts nothing.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from rlframe.rewards.sandbox_seccomp import build_filter

WORK = "/sandbox"
PACKAGES = "/packages"
SANDBOX_UID = 65534
"""The host uid (and gid) untrusted code runs as when rlframe runs as root: ``nobody``."""

# Runs first inside the sandbox as ``python -I -S -c LAUNCHER LIMITS_JSON SCRIPT``: sets the
# per-process rlimits, puts the working folder (and exposed packages) on sys.path, runs the
# script as __main__. It imports nothing from rlframe: the sandbox has no rlframe.
LAUNCHER = r"""
import json, os, resource, runpy, sys
limits, script = json.loads(sys.argv[1]), sys.argv[2]
mb = 1024 * 1024
resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb, limits["memory_mb"] * mb))
fsize = limits["file_size_mb"] * mb
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if limits["nproc"]:
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"], limits["nproc"]))
sys.argv = [script]
sys.path[0] = "/sandbox"
if limits["packages"]:
    sys.path.insert(1, "/packages")
if limits["ready_fd"] is not None:  # the program's wall clock starts now
    os.write(limits["ready_fd"], b"1")
    os.close(limits["ready_fd"])
del json, os, resource, limits, mb, fsize
runpy.run_path(script, run_name="__main__")
"""


class SandboxUnavailable(RuntimeError):
    """No sandbox can be built here; the message says why and what to install."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandbox may use: the launcher's per-process rlimits, the tmpfs sizes, and the
    whole sandbox's cgroups and wall clock (applied by :class:`rlframe.rewards.sandbox.Sandbox`)."""

    wall_s: float = 10.0
    """Wall-clock seconds from the program's start (the sandbox built) until the whole
    sandbox is killed."""
    cpu_s: int = 10
    """CPU seconds of each process (RLIMIT_CPU): SIGXCPU, then SIGKILL a second later."""
    memory_mb: int = 1024
    """Memory of the whole process tree (memory cgroup, tmpfs pages included) and address
    space of each process (RLIMIT_AS)."""
    disk_mb: int = 64
    """Size of each of the sandbox's tmpfs: the working folder, ``/tmp`` and ``/dev/shm``."""
    file_size_mb: int = 16
    """Largest file any process may write (RLIMIT_FSIZE); stdout and stderr count too."""
    processes: int = 16
    """Processes the program may have at once (pids cgroup)."""
    cpus: float = 1.0
    """CPU cores' worth of time the whole tree may use (CPU cgroup quota)."""


def interpreter() -> tuple[str, str]:
    """The real interpreter binary and its prefix (a venv's python is a link to it)."""
    return os.path.realpath(sys._base_executable), sys.base_prefix  # type: ignore[attr-defined]


def site_dirs(prefix: str) -> list[str]:
    """Folders of third-party packages under the interpreter's prefix and /usr: masked."""
    scheme = {"base": prefix, "platbase": prefix}
    found = {sysconfig.get_path("purelib", vars=scheme), sysconfig.get_path("platlib", vars=scheme)}
    major = f"python{sys.version_info.major}"
    found |= {f"/usr/lib/{major}/dist-packages", f"/usr/local/lib/{major}/dist-packages"}
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    found |= {f"/usr/local/lib/{minor}/site-packages", f"/usr/local/lib/{minor}/dist-packages"}
    return sorted(d for d in found if os.path.isdir(d))


def root_binds(prefix: str) -> list[str]:
    """bwrap arguments for the read-only system part of the root."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    if not prefix.startswith("/usr/"):
        # Mounted at its own path (binaries and libpython may hold it as RUNPATH); the
        # folders bwrap makes above it (e.g. /root/.pyenv) stay empty but for this path.
        args += ["--ro-bind", prefix, prefix]
        parent = Path(prefix).parent
        while str(parent) != "/":
            args += ["--chmod", "0711", str(parent)]
            parent = parent.parent
    for site in site_dirs(prefix):
        args += ["--tmpfs", site, "--remount-ro", site]
    return args


def package_binds(packages: Sequence[str]) -> list[str]:
    """Expose allow-listed top-level packages read-only under /packages."""
    import importlib.util

    args: list[str] = ["--dir", PACKAGES, "--chmod", "0755", PACKAGES] if packages else []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise SandboxUnavailable(f"package {name!r} asked for by the reward is not installed")
        if spec.submodule_search_locations:
            source = list(spec.submodule_search_locations)[0]
            args += ["--ro-bind", source, f"{PACKAGES}/{name}"]
        else:
            args += ["--ro-bind", spec.origin, f"{PACKAGES}/{Path(spec.origin).name}"]
    return args


def tmpfs(path: str, size_mb: int) -> list[str]:
    return ["--size", str(size_mb * 2**20), "--tmpfs", path, "--chmod", "1777", path]


def build_command(
    files: dict[str, int],
    script: str,
    limits: SandboxLimits,
    packages: Sequence[str],
    nproc: int,
    ready_fd: int | None = None,
    seccomp_fd: int | None = None,
) -> list[str]:
    """The bwrap command line; ``files`` maps a name in /sandbox to a readable fd, the
    launcher writes one byte to ``ready_fd`` (when given) just before the program starts,
    and bwrap reads the seccomp filter from ``seccomp_fd`` (when given)."""
    python, prefix = interpreter()
    command = ["bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
    command += ["--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    if seccomp_fd is not None:
        command += ["--seccomp", str(seccomp_fd)]
    as_root = os.geteuid() == 0
    if as_root:
        # bwrap does the mounts as root; setpriv then drops to nobody for good.
        command += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        command += ["--cap-add", "CAP_SETPCAP"]
    else:
        command += ["--unshare-user"]
    command += root_binds(prefix)
    command += ["--proc", "/proc", "--dev", "/dev", *tmpfs("/dev/shm", limits.disk_mb)]
    command += [*tmpfs("/tmp", limits.disk_mb), *tmpfs(WORK, limits.disk_mb)]
    for name, fd in files.items():
        command += ["--perms", "0644", "--file", str(fd), f"{WORK}/{name}"]
    command += package_binds(packages)
    command += ["--remount-ro", "/", "--chdir", WORK, "--clearenv"]
    for key, value in sandbox_env().items():
        command += ["--setenv", key, value]
    if as_root:
        ids = [f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups"]
        command += ["setpriv", *ids, "--inh-caps=-all", "--bounding-set=-all"]
        command += ["--no-new-privs", "--"]
    per_process = {
        **asdict(limits),
        "nproc": nproc,
        "packages": bool(packages),
        "ready_fd": ready_fd,
    }
    command += [python, "-I", "-S", "-c", LAUNCHER, json.dumps(per_process), script]
    return command


def seccomp_file() -> IO[bytes] | None:
    """The seccomp filter in a file to hand bwrap, or None on an architecture without one."""
    program = build_filter()
    if program is None:
        return None
    file = tempfile.TemporaryFile()
    file.write(program)
    file.seek(0)
    return file


def sandbox_env() -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": WORK,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
