"""Shared fixtures: one local Ray cluster per test session, GPU-marker skipping."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# vLLM's CPU backend and torch both read these at import; set them before any import.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The test cluster is local: keep Ray on loopback (see rlframe.controller.cluster).
if "RAY_ADDRESS" not in os.environ:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


# Tests that read machine-wide state (every bwrap process, every sandbox cgroup on the host)
# run on one xdist worker, one after another: under `pytest -n 2` a sandbox started by the
# other worker would show up in their checks.
MACHINE_WIDE_SANDBOX_MODULES = {
    "test_sandbox.py",
    "test_sandbox_hygiene.py",
    "test_sandbox_limits.py",
    "test_math_code_rewards.py",
    "test_reward_hacks.py",
    "test_reward_preflight.py",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    for item in items:
        if item.path.name in MACHINE_WIDE_SANDBOX_MODULES:
            item.add_marker(pytest.mark.xdist_group("sandbox"))
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
    from ray import cloudpickle

    from tests.ray import test_workers

    # Ray workers cannot import the tests package; ship the test worker classes by value.
    cloudpickle.register_pickle_by_value(test_workers)
    yield
    if started:
        ray.shutdown()
