"""The sandbox contains hostile programs and says what happened to each."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from rlframe.rewards.sandbox import SandboxLimits, detect_isolation, run_python

ISOLATED = detect_isolation().namespaces
needs_namespaces = pytest.mark.skipif(
    not ISOLATED, reason=f"no namespaces here: {detect_isolation().reason}"
)


def sandbox_processes() -> list[int]:
    """Processes whose working folder is (or was) a sandbox folder."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if "rlframe-sandbox-" in os.readlink(f"/proc/{pid}/cwd"):
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


@needs_namespaces
def test_writing_outside_its_folder_fails(tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    code = (
        f"try:\n    open({str(target)!r}, 'w').write('x')\n    print('wrote')\n"
        "except OSError as e:\n    print('refused', e.errno)\n"
    )
    result = run_python(code)
    assert result.stdout.strip() == "refused 30"  # EROFS: everything but its folder is read-only
    assert not target.exists()


def test_environment_is_scrubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLFRAME_TEST_SECRET", "hunter2")
    result = run_python("import os\nprint(sorted(os.environ))\nprint(dict(os.environ))")
    assert result.status == "ok"
    assert "hunter2" not in result.stdout and "RLFRAME_TEST_SECRET" not in result.stdout
    # PWD comes from the shell that joins the pids cgroup (when there is one): the sandbox folder.
    names = set(eval(result.stdout.splitlines()[0])) - {"PWD"}
    assert names == {"HOME", "LANG", "PATH", "PYTHONDONTWRITEBYTECODE", "TMPDIR"}


@needs_namespaces
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
    assert len(eval(lines[1])) <= 3  # its own PID namespace: the launcher and itself


@needs_namespaces
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


def test_without_namespaces_limits_still_hold_and_it_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlframe.rewards import sandbox

    forced = sandbox.Isolation(False, "forced off by the test", detect_isolation().process_cap)
    monkeypatch.setattr(sandbox, "detect_isolation", lambda: forced)
    monkeypatch.setattr(sandbox.warn_if_not_isolated, "warned", False, raising=False)
    assert not sandbox.warn_if_not_isolated().namespaces
    warning = capsys.readouterr().err
    assert (
        "forced off by the test" in warning
        and "network and the file system are NOT isolated" in warning
    )
    loop = run_python("while True:\n    pass\n", limits=SandboxLimits(wall_s=1.0))
    assert loop.status == "timeout" and not loop.isolation.namespaces
    hog = run_python("x = bytearray(1 << 30)\n", limits=SandboxLimits(memory_mb=256))
    assert hog.status == "error" and "MemoryError" in hog.stderr
    assert sandbox_processes() == []


def test_a_killed_reward_worker_takes_its_sandbox_with_it() -> None:
    from rlframe.config import RewardConfig
    from rlframe.rewards import RuleScorer

    scorer = RuleScorer("code_tests", RewardConfig(num_workers=1, timeout_s=1.5, on_error="zero"))
    try:
        tests = {"tests": ["assert True"], "time_limit_s": 60}
        out = scorer.score(["import time\ntime.sleep(60)"], [""], [tests])
        assert out.timeouts == [True]
        time.sleep(0.5)
        assert sandbox_processes() == []
    finally:
        scorer.close()
