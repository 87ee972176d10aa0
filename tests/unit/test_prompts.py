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
        json.dumps({"prompt": "1+2=", "ground_truth": 3, "source": "x"}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "copy ab="}], "ground_truth": "ab"}) + "\n"
    )
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.table({"prompt": ["2+2=", "9+9=" * 50], "ground_truth": ["4", "18"]}), parquet)
    records = load_prompt_records([str(jsonl), str(parquet)], "unused", tok, max_prompt_length=16, seed=0)
    assert [r.prompt for r in records] == ["1+2=", "copy ab=", "2+2="]  # the long one is dropped
    assert records[0].ground_truth == "3" and records[0].extra == {"source": "x"}
    assert records[0].prompt_ids == tok("1+2=", add_special_tokens=False)["input_ids"]


def test_missing_columns_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1="}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl row 0: a row needs a 'prompt' or 'messages'|ground_truth"):
        load_prompt_records([str(bad)], "unused", build_tiny_tokenizer(), 16, 0)


def test_synthetic_source() -> None:
    records = load_prompt_records([], "arithmetic", build_tiny_tokenizer(), 16, seed=1, synthetic_size=10)
    assert len(records) == 10 and all(r.prompt.endswith("=") for r in records)
    assert records[0].extra == {"task": "arithmetic"}
