"""Config keys of scale-out: rollout tensor parallelism, console log level, placement wait."""

from __future__ import annotations

import pytest

from rlframe.config import ConfigError
from tests.unit.config_trees import build


def test_tp_must_divide_the_ranks_of_a_node() -> None:
    cfg = build(
        rollout={"n": 4, "tensor_parallel_size": 2}, trainer={"procs_per_node": 4, "nnodes": 2}
    )
    assert cfg.rollout.tensor_parallel_size == 2
    # 3 ranks per node cannot hold whole TP=2 groups (one would span two nodes).
    with pytest.raises(
        ConfigError, match="rollout.tensor_parallel_size: 2 must divide trainer.procs_per_node = 3"
    ):
        build(
            rollout={"n": 3, "tensor_parallel_size": 2},
            trainer={"procs_per_node": 3},
            actor={"mini_batch_size": 24, "micro_batch_size": 1},
        )
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size"):
        build(rollout={"n": 4, "tensor_parallel_size": 0})


def test_tp_needs_the_vllm_engine() -> None:
    with pytest.raises(ConfigError, match="needs rollout.engine=vllm"):
        build(
            rollout={"n": 4, "tensor_parallel_size": 2, "engine": "hf"},
            trainer={"procs_per_node": 2},
        )


def test_log_level_and_placement_timeout_are_checked() -> None:
    assert build(trainer={"log_level": "info"}).trainer.log_level == "info"
    with pytest.raises(ConfigError, match="trainer.log_level: must be one of"):
        build(trainer={"log_level": "loud"})
    with pytest.raises(ConfigError, match="ray.placement_timeout_s"):
        build(ray={"placement_timeout_s": 0})
