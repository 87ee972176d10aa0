"""Sandbox limits hold at their setting, not at two or three times it: each limit is probed
just under and well under twice its value."""

from __future__ import annotations

import pytest

from rlframe.rewards.sandbox import run_python
from rlframe.rewards.sandbox_command import SandboxLimits

CPU_CLOCK = (
    "import time\n"
    "last = 0.0\n"
    "while True:\n"
    "    now = time.process_time()\n"
    "    if now - last > 0.05:\n"
    "        print(f'{now:.3f}', flush=True)\n"
    "        last = now\n"
)


def test_wall_clock_limit_at_its_setting() -> None:
    result = run_python("import time\ntime.sleep(60)\n", limits=SandboxLimits(wall_s=1.0))
    assert result.status == "timeout"
    assert 1.0 <= result.wall_s < 1.5, result.wall_s


def test_a_run_just_under_the_wall_clock_limit_finishes() -> None:
    result = run_python(
        "import time\ntime.sleep(0.5)\nprint('done')\n", limits=SandboxLimits(wall_s=2.0)
    )
    assert result.status == "ok" and result.stdout.strip() == "done"


def test_cpu_limit_at_its_setting() -> None:
    result = run_python(CPU_CLOCK, limits=SandboxLimits(wall_s=20.0, cpu_s=1))
    assert result.status == "signal" and result.exit_code == 128 + 24  # SIGXCPU
    used = float(result.stdout.split()[-1])
    # The last CPU time the program saw: up to its 1 s limit, never near 2 s.
    assert 0.8 <= used <= 1.2, used


@pytest.mark.parametrize("megabytes,fits", [(100, True), (400, False)])
def test_memory_limit_at_its_setting(megabytes: int, fits: bool) -> None:
    code = f"block = bytearray({megabytes} * 1024 * 1024)\nprint('allocated')\n"
    result = run_python(code, limits=SandboxLimits(memory_mb=256))
    if fits:
        assert result.status == "ok" and "allocated" in result.stdout, result.stderr
    else:
        assert result.status == "error" and "MemoryError" in result.stderr


@pytest.mark.parametrize("kilobytes,fits", [(900, True), (1500, False)])
def test_file_size_limit_at_its_setting(kilobytes: int, fits: bool) -> None:
    code = f"open('out.bin', 'wb').write(b'x' * {kilobytes} * 1024)\nprint('written')\n"
    result = run_python(code, limits=SandboxLimits(file_size_mb=1))
    if fits:
        assert result.status == "ok" and "written" in result.stdout, result.stderr
    else:
        assert result.status == "error" and "File too large" in result.stderr


def test_process_limit_at_its_setting() -> None:
    """Children that sleep, forked until refused: no more than the limit allows at once."""
    code = (
        "import os, time\n"
        "started = 0\n"
        "while True:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "    started += 1\n"
        "print(started, flush=True)\n"
    )
    result = run_python(code, limits=SandboxLimits(wall_s=10.0, processes=6))
    started = int(result.stdout.split()[0])
    assert 1 <= started <= 5, started


@pytest.mark.parametrize("code,status", [(3, "error"), (128, "error"), (129, "signal")])
def test_exit_codes_are_errors_up_to_128(code: int, status: str) -> None:
    """Above 128 the launcher reports a signal (128 + its number); 128 itself is an exit code."""
    result = run_python(f"import sys\nsys.exit({code})\n")
    assert (result.status, result.exit_code) == (status, code)


DEFAULT_LIMITS = """
import os, resource
for name in ("CPU", "AS", "FSIZE", "CORE"):
    soft, hard = resource.getrlimit(getattr(resource, "RLIMIT_" + name))
    print(name, soft, hard)
for folder in ("/sandbox", "/tmp", "/dev/shm"):
    stat = os.statvfs(folder)
    print(folder, stat.f_blocks * stat.f_frsize)
"""


def test_default_limits_as_the_program_sees_them() -> None:
    """10 CPU seconds (SIGKILL a second later), 1 GiB of address space, 16 MiB files, no
    core dumps, 64 MiB in each writable folder."""
    result = run_python(DEFAULT_LIMITS)
    assert result.ok, result.stderr
    mib = 1 << 20
    assert result.stdout.splitlines() == [
        "CPU 10 11",
        f"AS {1024 * mib} {1024 * mib}",
        f"FSIZE {16 * mib} {16 * mib}",
        "CORE 0 0",
        f"/sandbox {64 * mib}",
        f"/tmp {64 * mib}",
        f"/dev/shm {64 * mib}",
    ]
