"""ROLLOUT_DP_SPLIT: rows split over rollout data-parallel groups, TP ranks get the same rows."""

from __future__ import annotations

import pytest
import torch

from rlframe.controller.dispatch import Dispatch, collect_results, split_call
from rlframe.core.protocol import Batch


def make_batch(rows: int) -> Batch:
    return Batch(
        {"x": torch.arange(rows, dtype=torch.float32), "seed": torch.arange(rows) * 10},
        {"tag": list(range(rows))},
    )


def fake_generate(chunk: Batch, rank: int) -> Batch:
    """What a rank returns: its input rows, doubled, and who computed them."""
    return Batch(
        {"y": chunk["x"] * 2, "rank": torch.full((len(chunk),), rank)},
        {"tag": chunk.columns["tag"]},
    )


@pytest.mark.parametrize("world,tp,rows", [(4, 2, 6), (4, 4, 5), (2, 2, 3), (6, 3, 7), (4, 1, 5)])
def test_tp_ranks_share_rows_and_one_result_per_group_is_kept(
    world: int, tp: int, rows: int
) -> None:
    batch = make_batch(rows)
    fan_out = split_call(Dispatch.ROLLOUT_DP_SPLIT, world, (batch,), {}, tp_size=tp)
    assert [c.rank for c in fan_out.calls] == list(range(world))
    chunks = [c.args[0] for c in fan_out.calls]
    for rank in range(world):
        first = chunks[rank - rank % tp]
        # Same rows and the same per-row sampling seeds inside a TP group.
        assert torch.equal(chunks[rank]["x"], first["x"]) and torch.equal(
            chunks[rank]["seed"], first["seed"]
        )
    groups = [chunks[g * tp] for g in range(world // tp)]
    # Different groups get disjoint rows that, without the padding, cover the batch once.
    covered = torch.cat([g["x"] for g in groups])[:rows]
    assert torch.equal(covered, batch["x"])
    results = [fake_generate(chunks[r], r) for r in range(world)]
    merged = collect_results(Dispatch.ROLLOUT_DP_SPLIT, fan_out, results)
    assert torch.equal(merged["y"], batch["x"] * 2) and list(merged.columns["tag"]) == list(
        range(rows)
    )
    # Collected from the first rank of each group.
    assert set(merged["rank"].tolist()) <= set(range(0, world, tp))


def test_training_split_ignores_the_rollout_tp_size() -> None:
    fan_out = split_call(Dispatch.DP_SPLIT, 4, (make_batch(8),), {}, tp_size=2)
    assert [len(c.args[0]) for c in fan_out.calls] == [2, 2, 2, 2]
    assert len({tuple(c.args[0]["x"].tolist()) for c in fan_out.calls}) == 4


def test_world_not_a_multiple_of_tp_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of the tensor-parallel size"):
        split_call(Dispatch.ROLLOUT_DP_SPLIT, 3, (make_batch(4),), {}, tp_size=2)


def test_hybrid_generate_is_dispatched_by_rollout_groups() -> None:
    from workers.hybrid import HybridWorker

    assert HybridWorker.generate.__rlframe_dispatch__.mode is Dispatch.ROLLOUT_DP_SPLIT
    assert HybridWorker.update.__rlframe_dispatch__.mode is Dispatch.DP_SPLIT
