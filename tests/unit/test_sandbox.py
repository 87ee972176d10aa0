"""The sandbox contains hostile programs and says what happened to each."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from rlframe.rewards.sandbox import detect_isolation, run_python
from rlframe.rewards.sandbox_command import SandboxLimits
from tests.unit.sandbox_cgroups import owned_cgroups

ISOLATION = detect_isolation()
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the uid switch is made as root only")


def sandbox_processes() -> list[int]:
    """Processes of a sandbox: bwrap itself, or anything whose working folder is /sandbox."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            if cmd.endswith(b"bwrap") or os.readlink(f"/proc/{pid}/cwd") == "/sandbox":
                found.append(int(pid))
        except OSError:
            pass
    return found


def test_a_plain_program_runs_with_stdin_in_a_private_home() -> None:
    code = (
        "import os\nprint(input()[::-1])\nopen('note.txt', 'w').write('kept')\n"
        "print(open('note.txt').read(), os.getcwd() == os.environ['HOME'])"
    )
    result = run_python(code, "olleh\n")
    assert result.status == "ok" and result.exit_code == 0
    assert result.stdout.split() == ["hello", "kept", "True"]


def test_infinite_loop_is_stopped_at_the_wall_clock_limit() -> None:
    result = run_python("while True:\n    pass\n", limits=SandboxLimits(wall_s=1.0))
    assert result.status == "timeout" and result.exit_code is None
    assert 1.0 <= result.wall_s < 3.0
    assert sandbox_processes() == []


def test_cpu_limit_kills_with_sigxcpu() -> None:
    result = run_python("while True:\n    pass\n", limits=SandboxLimits(wall_s=10.0, cpu_s=1))
    assert result.status == "signal" and result.exit_code == 128 + 24  # SIGXCPU
    assert result.wall_s < 5.0


def test_fork_bomb_is_bounded_and_cleaned_up() -> None:
    # Every process forks as fast as it can; with 8 processes allowed, forks start failing
    # within milliseconds and everything is killed at the 2 s limit.
    bomb = (
        "import os, time\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError as e:\n"
        "        print('fork refused:', type(e).__name__, flush=True)\n"
        "        time.sleep(60)\n"
    )
    result = run_python(bomb, limits=SandboxLimits(wall_s=2.0, processes=8))
    assert result.status == "timeout"
    assert "fork refused: BlockingIOError" in result.stdout
    time.sleep(0.2)
    assert sandbox_processes() == []


def test_memory_hog_gets_memory_error() -> None:
    hog = "chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 1024 * 1024))\n"
    result = run_python(hog, limits=SandboxLimits(memory_mb=256))
    assert result.status == "error"
    assert "MemoryError" in result.stderr


def test_output_flood_stops_at_the_file_size_limit() -> None:
    result = run_python(
        "while True:\n    print('x' * 1000)\n", limits=SandboxLimits(file_size_mb=1, wall_s=10.0)
    )
    # Python ignores SIGXFSZ, so the write past the limit raises EFBIG instead.
    assert result.status == "error" and "File too large" in result.stderr
    assert len(result.stdout) <= 1 << 20 and result.wall_s < 5.0


def test_writing_outside_its_folder_fails(tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    code = (
        f"try:\n    open({str(target)!r}, 'w').write('x')\n    print('wrote')\n"
        "except OSError as e:\n    print('refused', e.errno)\n"
    )
    result = run_python(code)
    # ENOENT: the host's folders are not there at all (EROFS where bwrap made a parent).
    assert result.stdout.strip() in ("refused 2", "refused 30")
    assert not target.exists()


def test_environment_is_scrubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLFRAME_TEST_SECRET", "hunter2")
    result = run_python("import os\nprint(sorted(os.environ))\nprint(dict(os.environ))")
    assert result.status == "ok"
    assert "hunter2" not in result.stdout and "RLFRAME_TEST_SECRET" not in result.stdout
    # PWD is bwrap's, set by its --chdir: the sandbox folder.
    names = set(eval(result.stdout.splitlines()[0])) - {"PWD"}
    assert names == {"HOME", "LANG", "PATH", "PYTHONDONTWRITEBYTECODE", "TMPDIR"}


def test_other_processes_environment_is_invisible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLFRAME_TEST_SECRET", "hunter2")
    code = (
        f"import os\ntry:\n    print(open('/proc/{os.getpid()}/environ', 'rb').read())\n"
        "except OSError as e:\n    print('refused', type(e).__name__)\n"
        "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
    )
    result = run_python(code)
    assert "hunter2" not in result.stdout
    lines = result.stdout.splitlines()
    assert lines[0] == "refused FileNotFoundError"
    assert len(eval(lines[1])) <= 3  # its own PID namespace: bwrap's init and itself


def test_sockets_reach_nothing() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        code = (
            "import socket\n"
            f"for address in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
            "    try:\n        socket.create_connection(address, timeout=2)\n"
            "        print('connected')\n"
            "    except OSError as e:\n        print('refused', e.errno)\n"
        )
        result = run_python(code)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert "connected" not in result.stdout
    assert result.stdout.split().count("refused") == 2


def test_no_user_namespace_can_be_made_inside() -> None:
    code = (
        "import ctypes, subprocess, threading\n"
        "tool = subprocess.run(['unshare', '-U', '-r', 'true'], capture_output=True)\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "call = libc.unshare(0x10000000)\n"  # CLONE_NEWUSER
        "print(tool.returncode, call, ctypes.get_errno())\n"
        "thread = threading.Thread(target=print, args=('thread',))\n"
        "thread.start()\nthread.join()\n"
        "print(subprocess.run(['true']).returncode)\n"  # clone without CLONE_NEWUSER: fine
    )
    result = run_python(code)
    assert result.ok, result.stderr
    assert result.stdout.split() == ["1", "-1", "1", "thread", "0"]  # EPERM


KEYRING_CALLS = (
    "import ctypes, platform\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.syscall.restype = ctypes.c_long\n"
    "ADD, REQUEST, CTL = {'x86_64': (248, 249, 250), 'aarch64': (217, 218, 219)}"
    "[platform.machine()]\n"
    "def call(*args):\n"
    "    ctypes.set_errno(0)\n"
    "    return libc.syscall(*args), ctypes.get_errno()\n"
)


def test_the_kernel_keyring_is_refused() -> None:
    """Every sandbox runs as one uid, whose user keyring the kernel would share between them:
    a key one sample's program adds must not be readable by a later sandbox."""
    user_keyring = -4  # KEY_SPEC_USER_KEYRING
    write = KEYRING_CALLS + (
        f"print(*call(ADD, b'user', b'rlframe-secret', b'payload', 7, {user_keyring}))\n"
        f"print(*call(CTL, 0, {user_keyring}, 0))\n"  # KEYCTL_GET_KEYRING_ID
    )
    read = KEYRING_CALLS + (
        "key, err = call(REQUEST, b'user', b'rlframe-secret', None, 0)\n"
        "buf = ctypes.create_string_buffer(64)\n"
        "print(key, err, call(CTL, 11, key, buf, 64) if key > 0 else '', buf.value)\n"
    )
    wrote = run_python(write)
    assert wrote.ok, wrote.stderr
    assert wrote.stdout.split() == ["-1", "1", "-1", "1"]  # EPERM, EPERM
    got = run_python(read)
    assert got.ok, got.stderr
    assert got.stdout.split() == ["-1", "1", "b''"]  # EPERM; no payload


def test_a_killed_reward_worker_takes_its_sandbox_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlframe.config import RewardConfig
    from rlframe.rewards import RuleScorer

    before = owned_cgroups()
    # The reward workers' temporary folder: whatever they leave on disk would be here.
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    scorer = RuleScorer("code_tests", RewardConfig(num_workers=1, timeout_s=1.5, on_error="zero"))
    try:
        tests = {"tests": ["assert True"], "time_limit_s": 60}
        out = scorer.score(["import time\ntime.sleep(60)"], [""], [tests])
        assert out.timeouts == [True]
        time.sleep(0.5)
        assert sandbox_processes() == []
        assert owned_cgroups() - before == set()  # the pool removed the killed worker's groups
        assert list(scratch.iterdir()) == []
    finally:
        scorer.close()


def test_secrets_the_project_and_other_runs_are_invisible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    token = home / ".ray" / "auth_token"
    token.write_text("secret-ray-token")
    token.chmod(0o600)
    monkeypatch.setenv("HOME", str(home))
    run = tmp_path / "outputs" / "other_run"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    project = Path(__file__).resolve().parents[2]
    targets = [
        str(token),
        str(run / "metrics.jsonl"),
        str(project / "README.md"),
        str(project / "rlframe" / "__init__.py"),
        "/etc/shadow",
        "/etc/passwd",
        os.path.expanduser("~root/.bashrc"),
    ]
    listed = ["/root", "/home", "/work", "/tmp", "/dev/shm", str(tmp_path), "/etc", "/run"]
    code = (
        "import os\n"
        f"for path in {targets!r}:\n"
        "    try:\n        print('READ', path, open(path).read()[:20])\n"
        "    except OSError as e:\n        print('refused', e.errno)\n"
        f"for path in {listed!r}:\n"
        "    try:\n        print('LIST', path, os.listdir(path))\n"
        "    except OSError as e:\n        print('refused', e.errno)\n"
        "print('uid', os.getuid(), os.getgid(), os.getgroups())\n"
    )
    result = run_python(code)
    assert result.status == "ok", result.stderr
    lines = result.stdout.splitlines()
    assert "secret-ray-token" not in result.stdout and "READ" not in result.stdout
    # /tmp and /dev/shm are the sandbox's own, empty; nothing else of the host exists.
    listings = [line for line in lines if line.startswith("LIST")]
    assert listings == ["LIST /tmp []", "LIST /dev/shm []"]
    if os.geteuid() == 0:
        assert lines[-1] == "uid 65534 65534 []"


def test_no_host_unix_socket_can_be_reached(tmp_path: Path) -> None:
    path = str(tmp_path / "host.sock")
    abstract = f"\0rlframe-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX) as by_path, socket.socket(socket.AF_UNIX) as by_name:
        by_path.bind(path)
        by_name.bind(abstract)
        for listener in (by_path, by_name):
            listener.listen()
            listener.settimeout(0.3)
        code = (
            "import socket\n"
            f"for address in [{path!r}, {abstract!r}, '/tmp/ray/session_latest/sockets/raylet']:\n"
            "    s = socket.socket(socket.AF_UNIX)\n"
            "    try:\n        s.connect(address)\n        print('connected')\n"
            "    except OSError as e:\n        print('refused', e.errno)\n"
        )
        result = run_python(code)
        for listener in (by_path, by_name):
            with pytest.raises(TimeoutError):
                listener.accept()
    assert result.status == "ok" and "connected" not in result.stdout
    # ENOENT for paths (not in its root), ECONNREFUSED for the name (its own network namespace).
    assert result.stdout.split() == ["refused", "2", "refused", "111", "refused", "2"]


def test_no_project_packages_unless_allowed() -> None:
    code = (
        "for name in ['ray', 'torch', 'numpy', 'rlframe', 'packaging']:\n"
        "    try:\n        __import__(name)\n        print(name, 'imported')\n"
        "    except ImportError:\n        print(name, 'missing')\n"
    )
    bare = run_python(code)
    assert bare.stdout.split()[1::2] == ["missing"] * 5
    allowed = run_python(code, packages=("packaging",))
    assert allowed.stdout.split()[1::2] == ["missing"] * 4 + ["imported"]


@pytest.mark.skipif("memory" not in ISOLATION.controllers, reason="no writable memory cgroup here")
def test_memory_cap_holds_for_four_children_together() -> None:
    # Each child stays under the per-process RLIMIT_AS (512 MB) with 200 MB; four of them
    # together do not fit the sandbox's 512 MB: the cgroup's OOM killer ends some.
    code = (
        "import os, time\n"
        "for _ in range(4):\n"
        "    if os.fork() == 0:\n"
        "        block = bytearray(200 << 20)\n"
        "        for i in range(0, len(block), 4096):\n"
        "            block[i] = 1\n"
        "        time.sleep(2)\n"
        "        os._exit(0)\n"
        "done = sum(os.WIFEXITED(os.wait()[1]) for _ in range(4))\n"
        "print('finished', done)\n"
    )
    result = run_python(code, limits=SandboxLimits(memory_mb=512, wall_s=20))
    assert result.out_of_memory
    finished = int(result.stdout.split()[-1]) if result.stdout else 0
    assert finished <= 2


def test_disk_quota_holds_on_every_writable_folder() -> None:
    code = (
        "for folder in ['/sandbox', '/tmp', '/dev/shm']:\n"
        "    written = 0\n"
        "    try:\n"
        "        with open(folder + '/fill', 'wb') as f:\n"
        "            for _ in range(64):\n"
        "                f.write(b'x' * (1 << 20))\n"
        "                f.flush()\n"
        "                written += 1\n"
        "    except OSError as e:\n"
        "        print(folder, written, e.errno)\n"
    )
    result = run_python(code, limits=SandboxLimits(disk_mb=8, file_size_mb=100))
    assert result.status == "ok", result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert [r[0] for r in rows] == ["/sandbox", "/tmp", "/dev/shm"]
    assert all(int(r[1]) <= 8 and r[2] == "28" for r in rows)  # ENOSPC at the 8 MB quota


def test_without_bubblewrap_code_tests_stop_before_ray_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlframe.config import Config, ConfigError, ModelConfig, RewardConfig
    from rlframe.rewards import sandbox
    from rlframe.rewards.sandbox_command import SandboxUnavailable
    from rlframe.run.preflight import check_reward_inputs

    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    sandbox.detect_isolation.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
            run_python("print(1)")
        cfg = Config(model=ModelConfig(path="tiny:0"), reward=RewardConfig(fn="code_tests"))
        with pytest.raises(ConfigError, match="reward.fn: code_tests runs untrusted code, but"):
            check_reward_inputs(cfg)
    finally:
        sandbox.detect_isolation.cache_clear()
