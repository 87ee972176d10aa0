"""Shared fixtures: one local Ray cluster per test session (per xdist worker), the sandbox
tests one at a time, GPU-marker skipping."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# vLLM's CPU backend and torch both read these at import; set them before any import.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite runs two tests at once (`pytest -n 2`) on 2 cores, each with its own OpenMP
# threads (torch, vLLM's CPU backend). OpenMP's default spin-waiting then burns the core the
# other test needs: two grpo_tiny runs side by side took 1.4 s a step spinning, 0.42 s
# passive (0.38 s alone). Inherited by the CLI runs and their Ray workers.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The test cluster is local: keep Ray on loopback (see rlframe.controller.cluster).
if "RAY_ADDRESS" not in os.environ:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


# Tests that read machine-wide state (every bwrap process, every sandbox cgroup on the host)
# or start sandboxes: they run one at a time on this machine, whatever runs them (the two
# workers of `pytest -n 2`, two pytest sessions), or one's sandbox shows up in the other's
# checks. A lock file, not an xdist group: pytest 9.2 moved the node id that xdist 3.8's
# `loadgroup` rewrites, so groups are silently ignored.
SANDBOX_MODULES = {
    "test_sandbox.py",
    "test_sandbox_hygiene.py",
    "test_sandbox_limits.py",
    "test_math_code_rewards.py",
    "test_reward_hacks.py",
    "test_reward_preflight.py",
}
SANDBOX_LOCK = Path(tempfile.gettempdir()) / "rlframe-tests-sandbox.lock"


@pytest.fixture(autouse=True)
def one_sandbox_test_at_a_time(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.path.name not in SANDBOX_MODULES:
        yield
        return
    with SANDBOX_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local CPU Ray cluster shared by every test of the session.

    It advertises 4 CPUs on this 2-core machine: placement is what the tests check, and
    the test workers mostly wait.
    """
    from rlframe.config import RayConfig
    from rlframe.controller.cluster import init_ray

    started = init_ray(RayConfig(num_cpus=4))
    import ray

    yield
    if started:
        ray.shutdown()
