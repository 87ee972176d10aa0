"""rollout.placement and the rollout pool's keys: checked before Ray starts, one line each."""

from __future__ import annotations

import pytest

from rlframe.config import Config, ConfigError, Placement, build_config
from rlframe.config.placement import check_pools_fit, list_pools, resolve_actor_worker_cls
from rlframe.observability.logs import describe_pools
from tests.unit.cli_errors import check_config_error


def check_tiny_error(*overrides: str, key: str, text: str, local_ray: bool = False) -> None:
    """``+recipe=grpo_tiny OVERRIDES`` in-process stops with one line naming ``key``; it never
    reaches the launcher."""
    check_config_error("+recipe=grpo_tiny", *overrides, key=key, text=text, local_ray=local_ray)


@pytest.mark.parametrize(
    "overrides,key,text",
    [
        (
            ["rollout.procs_per_node=2"],
            "rollout.procs_per_node",
            "is only used with rollout.placement=separate (got 2 with rollout.placement=colocated)",
        ),
        (["rollout.cpus_per_proc=3"], "rollout.cpus_per_proc", "only used with"),
        (["rollout.nnodes=2"], "rollout.nnodes", "only used with"),
        (["rollout.worker_cls=my.Worker"], "rollout.worker_cls", "only used with"),
        (
            ["rollout.placement=separate", "rollout.sleep_level=2"],
            "rollout.sleep_level",
            "is only used with rollout.placement=colocated",
        ),
        (
            ["rollout.placement=separate", "rollout.tensor_parallel_size=2"],
            "rollout.tensor_parallel_size",
            "2 must divide rollout.procs_per_node = 1",
        ),
        (
            ["rollout.tensor_parallel_size=2"],
            "rollout.tensor_parallel_size",
            "2 must divide trainer.procs_per_node = 1",
        ),
        (
            ["rollout.placement=separate", "rollout.procs_per_node=0"],
            "rollout.procs_per_node",
            "must be > 0",
        ),
        (
            ["rollout.placement=separate", "rollout.worker_cls=workers.hybrid.HybridWorker"],
            "rollout.worker_cls",
            "cannot serve as a RolloutGroup: it has no @dispatch method init_weight_group, "
            "receive_weights",
        ),
    ],
)
def test_placement_mistakes_exit_2_naming_the_key(overrides, key: str, text: str) -> None:
    check_tiny_error(*overrides, key=key, text=text)


@pytest.mark.parametrize(
    "overrides,key,text",
    [
        (
            ["rollout.placement=separate", "rollout.cpus_per_proc=1", "ray.num_cpus=2"],
            "rollout.cpus_per_proc",
            "trainer pool 1 node(s) x 1 proc(s) x 2 CPU(s) + rollout pool 1 node(s) x 1 proc(s) "
            "x 1 CPU(s) = 3 CPUs, but the Ray this run starts has 2 (ray.num_cpus)",
        ),
        (
            ["trainer.procs_per_node=2", "ray.num_cpus=2"],
            "trainer.cpus_per_proc",
            "= 4 CPUs, but the Ray this run starts has 2",
        ),
        (
            ["rollout.placement=separate", "rollout.nnodes=2", "trainer.cpus_per_proc=1"],
            "rollout.nnodes",
            "is 2, but the Ray this run starts is this one machine",
        ),
    ],
)
def test_pools_that_cannot_fit_a_local_ray_exit_2_before_it_starts(
    overrides, key, text, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the run would start its own Ray
    check_tiny_error(*overrides, key=key, text=text, local_ray=True)


def config(**rollout: object) -> Config:
    return build_config({"model": {"path": "tiny:0"}, "rollout": rollout})


def test_an_unknown_placement_names_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"rollout.placement: .*\[colocated, separate\]"):
        config(placement="apart")


def test_separate_pools_and_their_fit() -> None:
    cfg = config(placement="separate", procs_per_node=2, tensor_parallel_size=2, cpus_per_proc=1)
    assert cfg.rollout.placement is Placement.separate
    trainer, rollout = list_pools(cfg.rollout, cfg.trainer)
    assert (trainer.section, trainer.world_size, rollout.section, rollout.world_size) == (
        "trainer",
        1,
        "rollout",
        2,
    )
    check_pools_fit(cfg.rollout, cfg.trainer, 3, "test")  # 1 + 2 CPUs
    with pytest.raises(ConfigError, match=r"^rollout.cpus_per_proc: .* = 3 CPUs, .* has 2"):
        check_pools_fit(cfg.rollout, cfg.trainer, 2, "test")
    assert resolve_actor_worker_cls(cfg.rollout, cfg.actor) == "workers.train_worker.TrainWorker"
    colocated = config()
    assert [p.section for p in list_pools(colocated.rollout, colocated.trainer)] == ["trainer"]
    assert (
        resolve_actor_worker_cls(colocated.rollout, colocated.actor)
        == "workers.hybrid.HybridWorker"
    )


def test_startup_summary_shows_both_pools() -> None:
    lines = describe_pools(config(placement="separate", procs_per_node=2), "cuda")
    assert lines["world"] == "1 rank(s) = 1 node(s) x 1, training"
    assert lines["rollout world"] == (
        "2 rank(s) = 1 node(s) x 2, rollout (separate); 2 vllm engine(s) of tensor-parallel size 1"
    )
    assert lines["rollout devices"] == "cuda, 1 GPU + 1 CPU(s) per rank"
    colocated = describe_pools(config(), "cpu")
    assert set(colocated) == {"world", "mesh", "devices"}
    assert "training + rollout (colocated)" in colocated["world"]
