"""Batch: row alignment through chunk, concat, repeat, select, union and padding."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from rlframe.core.protocol import Batch


def make(n: int) -> Batch:
    return Batch(
        {"ids": torch.arange(n * 2).view(n, 2), "score": torch.arange(n, dtype=torch.float32)},
        {"answer": [str(i) for i in range(n)]},
        {"version": 3},
    )


def test_rows_must_agree() -> None:
    with pytest.raises(ValueError, match="rows disagree"):
        Batch({"a": torch.zeros(3)}, {"b": ["x", "y"]})


def test_chunk_sizes_differ_by_at_most_one_and_concat_restores() -> None:
    b = make(7)
    parts = b.chunk(3)
    assert [len(p) for p in parts] == [3, 2, 2]
    back = Batch.concat(parts)
    assert torch.equal(back["ids"], b["ids"]) and list(back["answer"]) == list(b["answer"])
    assert back.meta == {"version": 3}


def test_chunk_more_parts_than_rows_gives_empty_parts() -> None:
    assert [len(p) for p in make(2).chunk(3)] == [1, 1, 0]


def test_repeat_is_interleaved() -> None:
    r = make(2).repeat(3)
    assert r["score"].tolist() == [0, 0, 0, 1, 1, 1]
    assert list(r["answer"]) == ["0", "0", "0", "1", "1", "1"]


def test_select_and_union() -> None:
    b = make(3)
    left, right = b.select(["ids"]), b.select(["score", "answer"])
    assert left.keys() == ["ids"]
    both = left.union(right)
    assert sorted(both.keys()) == ["answer", "ids", "score"]
    with pytest.raises(KeyError, match="nope"):
        b.select(["nope"])
    other = b.with_tensors(score=torch.ones(3))
    with pytest.raises(ValueError, match="score"):
        b.union(other)


def test_pad_to_multiple_copies_leading_rows() -> None:
    padded, pad = make(5).pad_to_multiple(4)
    assert pad == 3 and len(padded) == 8
    assert padded["score"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    same, none = make(4).pad_to_multiple(4)
    assert none == 0 and len(same) == 4


def test_split_by_size() -> None:
    assert [len(p) for p in make(7).split(3)] == [3, 3, 1]


def test_object_columns_keep_python_objects() -> None:
    b = Batch(columns={"gt": [[1, 2], [3], []]})
    assert b["gt"][1] == [3] and len(b) == 3
    assert b.rows([2, 0])["gt"].tolist() == [[], [1, 2]]


def test_pickle_round_trip() -> None:
    b = make(4)
    c = pickle.loads(pickle.dumps(b))
    assert torch.equal(c["ids"], b["ids"]) and np.array_equal(c["answer"], b["answer"])


def test_typed_reads_name_the_key_of_the_wrong_kind() -> None:
    b = make(2)
    assert b.tensor("score") is b.tensors["score"]
    assert b.column("answer") is b.columns["answer"]
    with pytest.raises(TypeError, match="'answer' is a column, not a tensor"):
        b.tensor("answer")
    with pytest.raises(TypeError, match="'ids' is a tensor, not a column"):
        b.column("ids")
    with pytest.raises(KeyError, match="no tensor 'reward'"):
        b.tensor("reward")
    with pytest.raises(KeyError, match="no column 'reward'"):
        b.column("reward")


def test_constructor_copies_its_mappings() -> None:
    """A batch built from another's dicts (``Batch(b.tensors, ..., b.meta)``) must not write
    through to it: a worker sets ``meta["engine_s"]`` on its output."""
    tensors, meta = {"a": torch.zeros(2)}, {"v": 1}
    b = Batch(tensors, meta=meta)
    b.tensors["c"] = torch.ones(2)
    b.meta["v"] = 2
    assert list(tensors) == ["a"] and meta == {"v": 1}
    assert len(Batch()) == 0 and Batch().keys() == []
