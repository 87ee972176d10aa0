"""GPU arithmetic of the pools before a local Ray starts (desk check item 3): every bundle is
one whole GPU, and a separate rollout pool cannot share the trainer's GPUs (its ranks and the
trainer's join one NCCL weight group, and NCCL refuses two ranks on one device)."""

from __future__ import annotations

import pytest

from rlframe.config import Config, ConfigError, build_config
from rlframe.config.placement import check_pools_gpus
from rlframe.run.preflight import check_local_pools


def make_config(placement: str, trainer_procs: int, rollout_procs: int = 1) -> Config:
    rollout = {"placement": placement}
    if placement == "separate":
        rollout["procs_per_node"] = rollout_procs
    return build_config(
        {
            "model": {"path": "tiny:0"},
            "trainer": {"procs_per_node": trainer_procs, "device": "cuda"},
            "rollout": rollout,
        }
    )


@pytest.mark.parametrize(
    ("placement", "trainer_procs", "rollout_procs", "gpus"),
    [("colocated", 1, 1, 1), ("colocated", 4, 1, 4), ("separate", 1, 1, 2), ("separate", 2, 2, 4)],
)
def test_pools_that_fit_the_gpus(
    placement: str, trainer_procs: int, rollout_procs: int, gpus: int
) -> None:
    cfg = make_config(placement, trainer_procs, rollout_procs)
    check_pools_gpus(cfg.rollout, cfg.trainer, gpus, "test")


@pytest.mark.parametrize(
    ("placement", "trainer_procs", "rollout_procs", "gpus", "key"),
    [
        # One GPU: the trainer would fit, the rollout engine has no GPU of its own.
        ("separate", 1, 1, 1, "rollout.placement"),
        ("separate", 2, 2, 3, "rollout.placement"),
        ("colocated", 2, 1, 1, "trainer.procs_per_node"),
        ("separate", 2, 1, 1, "trainer.procs_per_node"),
    ],
)
def test_pools_over_the_gpus_are_refused(
    placement: str, trainer_procs: int, rollout_procs: int, gpus: int, key: str
) -> None:
    cfg = make_config(placement, trainer_procs, rollout_procs)
    with pytest.raises(ConfigError) as e:
        check_pools_gpus(cfg.rollout, cfg.trainer, gpus, "test")
    assert e.value.key == key


def test_preflight_refuses_cuda_on_a_machine_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    # This CPU machine has no GPU: trainer.device=cuda with a local Ray is refused before it
    # starts, naming the key (instead of waiting placement_timeout_s for a GPU bundle).
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError) as e:
        check_local_pools(make_config("colocated", 1))
    assert e.value.key == "trainer.procs_per_node"
