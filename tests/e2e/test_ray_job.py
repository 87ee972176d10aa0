"""The "Ray job submission" commands of docs/running.md, run as written against a loopback
head node.

``ray start --head`` (token authentication on), then ``ray job submit --working-dir . --
python -m rlframe.main ...`` completes with its run directory and logs where that page says,
and ``ray.address=auto`` joins the running cluster. The head is started with ``--block`` so
that this test owns its process and stops it by pid (never ``ray stop``, which stops every
Ray on the machine).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.harness import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")


# A HOME of the tests' own: Ray keeps its token in ~/.ray/auth_token, and this machine's may
# already hold one (any local ray.init writes it). A fresh HOME is a machine that never ran Ray.
HOME: dict[str, str] = {}


def documented_env() -> dict[str, str]:
    """The shell the page's commands run in: token auth on, nothing pointing at another cluster."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")
    }
    return env | HOME | {"RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A head node on loopback, started as the page says from a HOME without a Ray token:
    yields the dashboard address once the dashboard answers and the dashboard agent, which
    runs submitted jobs, listens."""
    HOME["HOME"] = str(tmp_path_factory.mktemp("home"))
    subprocess.run(
        [RAY, "get-auth-token", "--generate"],
        env=documented_env(),
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert (Path(HOME["HOME"]) / ".ray" / "auth_token").is_file()
    dashboard_port, agent_port = free_port(), free_port()
    log = (tmp_path_factory.mktemp("head") / "head.txt").open("w")
    process = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1",
            f"--port={free_port()}",
            f"--dashboard-port={dashboard_port}",
            # Ray's default agent port (52365) is taken by any other Ray on the machine (the
            # other worker's cluster under `pytest -n 2`); its agent then serves no HTTP and
            # every submit is answered "No available agent to submit job".
            f"--dashboard-agent-listen-port={agent_port}",
            "--num-cpus=2",
            "--disable-usage-stats",
            "--block",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=documented_env(),
        cwd=REPO,
    )
    address = f"http://127.0.0.1:{dashboard_port}"
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while not (dashboard_answers(address) and port_listens(agent_port)):
            assert process.poll() is None and time.monotonic() < deadline, (
                "the head node did not start"
            )
            time.sleep(1)
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        yield address
    finally:
        tree += (
            [p for p in psutil.Process(process.pid).children(recursive=True) if p not in tree]
            if process.poll() is None
            else []
        )
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def port_listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def dashboard_answers(address: str) -> bool:
    try:
        urllib.request.urlopen(address + "/api/version", timeout=2)
        return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def test_token_auth_is_on(head: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(head + "/api/jobs/", timeout=10)
    assert error.value.code == 401


def test_job_submit_runs_and_writes_where_the_docs_say(head: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "outputs" / "job"
    start = time.monotonic()
    result = submit_job(
        "python",
        "-m",
        "rlframe.main",
        "+recipe=grpo_tiny",
        "trainer.total_steps=2",
        f"trainer.output_dir={run_dir}",
        head=head,
    )
    print(f"job took {time.monotonic() - start:.0f} s")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "AuthenticationError" not in result.stdout + result.stderr
    assert "succeeded" in result.stdout + result.stderr
    # The job's output is rlframe's console: summary and step lines, joined, not started.
    assert "rlframe: ray      joined 127.0.0.1:" in result.stdout and "step 2/2" in result.stdout
    steps = [
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2]
    assert (run_dir / "logs" / "driver.log").exists() and (
        run_dir / "logs" / "actor_rank0.log"
    ).stat().st_size > 0


def submit_job(*entrypoint: str, head: str) -> subprocess.CompletedProcess[str]:
    """``ray job submit`` as the page has it."""
    return run_as_documented(
        [RAY, "job", "submit", "--address", head, "--working-dir", ".", "--", *entrypoint]
    )


def run_as_documented(command: list[str]) -> subprocess.CompletedProcess[str]:
    """``command`` in the page's shell (:func:`documented_env`), from the repository root."""
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        env=documented_env(),
        cwd=REPO,
    )


def test_address_auto_joins_the_running_cluster(head: str, tmp_path: Path) -> None:
    result = run_as_documented(
        [
            sys.executable,
            "-m",
            "rlframe.main",
            "+recipe=grpo_tiny",
            "ray.address=auto",
            "trainer.total_steps=1",
            f"trainer.output_dir={tmp_path / 'run'}",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rlframe: ray      joined 127.0.0.1:" in result.stdout
    assert "Started a local Ray instance" not in result.stdout + result.stderr
    assert (
        "Started a local Ray instance" not in (tmp_path / "run" / "logs" / "driver.log").read_text()
    )
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text())["step"] == 1
    # The joined cluster outlives the run: the job submitted next still runs on it.
