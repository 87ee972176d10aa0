"""How a driver call fans out to ranks and how results come back, without Ray
(tests/ray/test_dispatch.py drives the same code through real worker groups)."""

from __future__ import annotations

import pytest
import torch

from rlframe.controller.dispatch import Dispatch, collect_results, split_call
from rlframe.core.protocol import Batch


def rows(n: int) -> Batch:
    return Batch({"x": torch.arange(n, dtype=torch.float32)})


def test_rank_zero_calls_rank_zero_alone() -> None:
    fan_out = split_call(Dispatch.RANK_ZERO, 4, ("a",), {"k": 1})
    assert [(c.rank, c.args, c.kwargs) for c in fan_out.calls] == [(0, ("a",), {"k": 1})]
    assert collect_results(Dispatch.RANK_ZERO, fan_out, ["rank 0's result"]) == "rank 0's result"


def test_one_to_all_calls_every_rank_with_the_same_arguments() -> None:
    fan_out = split_call(Dispatch.ONE_TO_ALL, 3, (7,), {})
    assert [(c.rank, c.args) for c in fan_out.calls] == [(0, (7,)), (1, (7,)), (2, (7,))]
    assert collect_results(Dispatch.ONE_TO_ALL, fan_out, [0, 1, 2]) == [0, 1, 2]


def test_dp_split_pads_chunks_and_strips_the_padding() -> None:
    fan_out = split_call(Dispatch.DP_SPLIT, 2, (rows(5),), {"scale": 2.0})
    assert [c.args[0]["x"].tolist() for c in fan_out.calls] == [[0.0, 1.0, 2.0], [3.0, 4.0, 0.0]]
    assert all(c.kwargs == {"scale": 2.0} for c in fan_out.calls)
    merged = collect_results(Dispatch.DP_SPLIT, fan_out, [c.args[0] for c in fan_out.calls])
    assert merged["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_dp_split_refuses_calls_without_a_batch_or_with_ragged_batches() -> None:
    with pytest.raises(TypeError, match="needs at least one Batch or TrainBatch argument"):
        split_call(Dispatch.DP_SPLIT, 2, (torch.zeros(4),), {})
    with pytest.raises(ValueError, match=r"different lengths: \[3, 4\]"):
        split_call(Dispatch.DP_SPLIT, 2, (rows(4),), {"other": rows(3)})


def test_dp_split_result_with_the_wrong_row_count_names_the_rank() -> None:
    fan_out = split_call(Dispatch.DP_SPLIT, 2, (rows(4),), {})
    with pytest.raises(ValueError, match="rank 1 returned 1 rows for 2 input rows"):
        collect_results(Dispatch.DP_SPLIT, fan_out, [rows(2), rows(1)])
