"""Data prep writes the prompt files the GPU recipes read, from local files in the hub's format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlframe.data.prepare import extract_gsm8k_answer, extract_last_boxed, prepare
from rlframe.data.prompts import read_rows
from rlframe.rewards import REWARDS

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def test_answer_extraction() -> None:
    assert extract_gsm8k_answer("so 3,600 pencils.\n#### 3,600") == "3600"
    assert (
        extract_last_boxed("first \\boxed{1} then \\boxed{\\frac{a}{b^{2}}} done")
        == "\\frac{a}{b^{2}}"
    )
    assert extract_last_boxed("$\\fbox{7}$") == "7"
    with pytest.raises(ValueError, match="without"):
        extract_last_boxed("no box")
    with pytest.raises(ValueError, match="unbalanced"):
        extract_last_boxed("\\boxed{1")


def test_gsm8k_through_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "gsm8k"
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "cache"),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlframe.data.prepare",
            "gsm8k",
            "--source",
            str(FIXTURES / "gsm8k"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "train.parquet (3 rows)" in done.stdout and "test.parquet (2 rows)" in done.stdout
    train, test = read_rows(out / "train.parquet"), read_rows(out / "test.parquet")
    assert [r["ground_truth"] for r in train] == ["72", "10", "3600"]
    assert [r["ground_truth"] for r in test] == ["18", "3"]
    assert all(
        r["data_source"] == "openai/gsm8k" and r["prompt"].endswith('after "####".')
        for r in train + test
    )
    assert train[0]["prompt"].startswith("Natalia sold clips")
    raw = [
        json.loads(line) for line in (FIXTURES / "gsm8k" / "train.jsonl").read_text().splitlines()
    ]
    # The data set's own solutions score 1 with both math rewards.
    for row, solution in zip(train, raw):
        assert REWARDS.get("math_answer")(solution["answer"], row["ground_truth"], {}) == 1.0
        assert REWARDS.get("math_verify")(solution["answer"], row["ground_truth"], {}) == 1.0


def test_math(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    counts = prepare("math", tmp_path / "math", FIXTURES / "math")
    assert counts == {"train": 3, "test": 2}
    train = read_rows(tmp_path / "math" / "train.parquet")
    test = read_rows(tmp_path / "math" / "test.parquet")
    assert [r["ground_truth"] for r in train] == ["\\frac{5}{6}", "2\\sqrt{2}", "2"]
    assert [r["ground_truth"] for r in test] == ["\\{1, 2\\}", "10"]
    assert train[1]["level"] == "Level 2" and train[1]["type"] == "Algebra"
    raw = [
        json.loads(line) for line in (FIXTURES / "math" / "train.jsonl").read_text().splitlines()
    ]
    for row, source in zip(train, raw):
        assert REWARDS.get("math_verify")(source["solution"], row["ground_truth"], {}) == 1.0


def test_missing_split_is_named(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    with pytest.raises(ValueError, match="no test.jsonl"):
        prepare("gsm8k", tmp_path / "out", tmp_path)
