"""TrainBatch: optional fields stay row-aligned (or None) through the row operations, and
the driver's Batch becomes one with the fields a training method reads, or fails naming
what is missing."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch

from rlframe.controller.dispatch import Dispatch, collect_results, split_call
from rlframe.core.protocol import Batch
from rlframe.core.train_batch import FORWARD, POLICY_UPDATE, TrainBatch, TrainReads


def grids(n: int, width: int = 3) -> dict[str, torch.Tensor]:
    """The five required grids, row ``i`` holding ``i`` everywhere (so rows are traceable)."""
    row = torch.arange(n)[:, None]
    return {
        "prompt_ids": row.repeat(1, 2),
        "prompt_mask": torch.ones(n, 2, dtype=torch.long),
        "response_ids": row.repeat(1, width),
        "response_mask": torch.ones(n, width),
        "loss_mask": torch.ones(n, width),
    }


def make(n: int) -> TrainBatch:
    """Rows with advantages, teacher top-k ids and images; the other optionals None."""
    return TrainBatch(
        **grids(n),
        advantages=torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 3),
        teacher_top_ids=torch.arange(n)[:, None, None].repeat(1, 3, 2),
        images=[[bytes([i])] * (i % 2) for i in range(n)],
    )


def assert_rows(batch: TrainBatch, rows: list[int]) -> None:
    """``batch`` holds exactly the rows ``rows`` of :func:`make`, in that order."""
    assert batch.prompt_ids[:, 0].tolist() == rows
    assert batch.response_ids[:, -1].tolist() == rows
    assert batch.advantages is not None and batch.advantages[:, 0].tolist() == rows
    assert batch.teacher_top_ids is not None and batch.teacher_top_ids[:, 0, 0].tolist() == rows
    assert batch.images == [[bytes([i])] * (i % 2) for i in rows]
    assert batch.old_logprobs is None and batch.routed_experts is None and batch.row_index is None


def test_chunk_and_concat_keep_every_field_aligned() -> None:
    batch = make(7)
    parts = batch.chunk(3)
    assert [len(p) for p in parts] == [3, 2, 2]
    assert_rows(parts[1], [3, 4])
    assert_rows(TrainBatch.concat(parts), list(range(7)))


def test_rows_split_and_padding_keep_every_field_aligned() -> None:
    batch = make(5)
    assert_rows(batch.rows([4, 0, 2]), [4, 0, 2])
    assert_rows(batch.rows(torch.tensor([1, 1])), [1, 1])
    assert_rows(batch.rows(slice(1, 3)), [1, 2])
    assert [len(p) for p in batch.split(2)] == [2, 2, 1]
    padded, pad = batch.pad_to_multiple(4)
    assert pad == 3
    assert_rows(padded, [0, 1, 2, 3, 4, 0, 1, 2])


def test_concat_refuses_a_field_only_some_parts_have() -> None:
    a, b = make(2), make(2)
    with pytest.raises(ValueError, match="only some have advantages"):
        TrainBatch.concat([a, replace(b, advantages=None)])


def test_rows_must_agree() -> None:
    with pytest.raises(ValueError, match="rows disagree"):
        replace(make(3), advantages=torch.zeros(2, 3))


def test_dp_split_chunks_a_train_batch_and_round_trips_through_pickle() -> None:
    """The worker group pads a TrainBatch for the ranks and chunks it like a Batch."""
    fan_out = split_call(Dispatch.DP_SPLIT, 2, (make(3),), {})
    shares = [pickle.loads(pickle.dumps(c.args[0])) for c in fan_out.calls]
    assert [len(s) for s in shares] == [2, 2] and fan_out.padding == 1
    assert_rows(shares[0], [0, 1])
    assert_rows(shares[1], [2, 0])
    results = [Batch({"x": s.prompt_ids[:, 0]}) for s in shares]
    assert collect_results(Dispatch.DP_SPLIT, fan_out, results)["x"].tolist() == [0, 1, 2]


def test_build_takes_the_declared_optional_fields_the_batch_has() -> None:
    n = 4
    driver = Batch(
        grids(n)
        | {
            "advantages": torch.ones(n, 3),
            "old_logprobs": -torch.ones(n, 3),
            "token_version": torch.zeros(n, 3, dtype=torch.long),
        },
        {"images": [[b"a"], None, [], [b"b", b"c"]], "prompt": ["text"] * n},
    )
    update = POLICY_UPDATE.build(driver)
    assert update.advantages is not None and update.old_logprobs is not None
    assert update.images == [[b"a"], [], [], [b"b", b"c"]]
    assert update.ref_logprobs is None and update.routed_experts is None  # not in the Batch
    forward = FORWARD.build(driver)
    assert forward.advantages is None and forward.old_logprobs is None  # not read
    assert torch.equal(forward.loss_mask, driver.tensor("loss_mask"))


def test_an_absent_required_grid_fails_naming_it() -> None:
    driver = Batch({k: v for k, v in grids(2).items() if k != "loss_mask"})
    with pytest.raises(KeyError, match="loss_mask"):
        FORWARD.build(driver)
    with pytest.raises(TypeError, match="loss_mask"):
        TrainBatch(**{k: v for k, v in grids(2).items() if k != "loss_mask"})  # type: ignore[arg-type]


def test_a_misspelt_field_fails_at_declaration() -> None:
    with pytest.raises(ValueError, match=r"no optional field \['old_logprob'\]"):
        TrainReads(("advantages", "old_logprob"))
    with pytest.raises(ValueError, match="needs \\['loss_mask'\\]"):
        TrainBatch(**grids(2) | {"loss_mask": None})  # type: ignore[arg-type]
