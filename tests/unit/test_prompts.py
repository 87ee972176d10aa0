"""Prompt files (parquet, jsonl) and the synthetic source, through the tiny tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlframe.data.prompts import load_prompt_records
from rlframe.data.tiny_model import build_tiny_tokenizer


def test_jsonl_and_parquet_rows(tmp_path: Path) -> None:
    tok = build_tiny_tokenizer()
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(
        json.dumps({"prompt": "1+2=", "ground_truth": 3, "source": "x"})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "copy ab="}], "ground_truth": "ab"})
        + "\n"
    )
    parquet = tmp_path / "b.parquet"
    pq.write_table(
        pa.table({"prompt": ["2+2=", "9+9=" * 50], "ground_truth": ["4", "18"]}), parquet
    )
    records = load_prompt_records(
        [str(jsonl), str(parquet)], "unused", tok, max_prompt_length=16, seed=0
    )
    assert [r.prompt for r in records] == ["1+2=", "copy ab=", "2+2="]  # the long one is dropped
    assert records[0].ground_truth == "3" and records[0].extra == {"source": "x"}
    assert records[0].prompt_ids == tok("1+2=", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "row,message",
    [
        # ground_truth is present: only the prompt/messages check can reject this row.
        (
            {"question": "1+1=", "ground_truth": "2"},
            "a row needs a 'prompt' or 'messages' column; it has ['ground_truth', 'question']",
        ),
        ({"prompt": "1+1="}, "a row needs a 'ground_truth' column; it has ['prompt']"),
    ],
)
def test_missing_columns_are_named(tmp_path: Path, row: dict, message: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": "2+2=", "ground_truth": "4"}) + "\n" + json.dumps(row) + "\n"
    )
    with pytest.raises(ValueError) as info:
        load_prompt_records([str(bad)], "unused", build_tiny_tokenizer(), 16, 0)
    # The whole message, with the file and the row that lacks the column.
    assert str(info.value) == f"{bad} row 1: {message}"


def test_synthetic_source() -> None:
    records = load_prompt_records(
        [], "arithmetic", build_tiny_tokenizer(), 16, seed=1, synthetic_size=10
    )
    assert len(records) == 10 and all(r.prompt.endswith("=") for r in records)
    assert records[0].extra == {"task": "arithmetic"}
