"""Prompt data sets: parquet/jsonl files or a synthetic task, tokenised once on the driver.

A file row has ``prompt`` (text) or ``messages`` (chat turns), and ``ground_truth``; any
other columns travel along to the reward function. The tokenizer's chat template is applied
when it has one, so instruct models see prompts the way they were trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlframe.data.tasks import generate_examples


@dataclass
class PromptRecord:
    prompt: str
    """The text the model continues (after the chat template, if any)."""
    prompt_ids: list[int]
    ground_truth: str
    extra: dict[str, Any]
    """Every other column of the row, passed to the reward function."""


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a .parquet, .jsonl or .json file as dicts."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix == ".jsonl":
        with path.open() as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.suffix == ".json":
        rows = json.loads(path.read_text())
        if not isinstance(rows, list):
            raise ValueError(f"{path}: a .json prompt file must hold a list of rows")
        return rows
    raise ValueError(f"{path}: prompt files must be .parquet, .jsonl or .json")


def render_prompt(row: dict[str, Any], tokenizer: Any, where: str) -> str:
    """The prompt text of a row, through the chat template when the tokenizer has one."""
    if "messages" in row:
        messages = row["messages"]
    elif "prompt" in row:
        messages = row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
    else:
        raise ValueError(f"{where}: a row needs a 'prompt' or 'messages' column; it has {sorted(row)}")
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(m["content"] for m in messages)


def load_prompt_records(
    files: list[str], task: str, tokenizer: Any, max_prompt_length: int, seed: int, synthetic_size: int = 4096
) -> list[PromptRecord]:
    """All prompts, tokenised; those longer than ``max_prompt_length`` tokens are dropped."""
    rows: list[tuple[dict[str, Any], str]] = []
    if files:
        for name in files:
            path = Path(name)
            rows += [(row, f"{name} row {i}") for i, row in enumerate(read_rows(path))]
    else:
        rows = [
            ({"prompt": e.prompt, "ground_truth": e.ground_truth, "task": e.task}, f"task {task} #{i}")
            for i, e in enumerate(generate_examples(task, synthetic_size, seed))
        ]
    records = []
    for row, where in rows:
        if "ground_truth" not in row:
            raise ValueError(f"{where}: a row needs a 'ground_truth' column; it has {sorted(row)}")
        text = render_prompt(row, tokenizer, where)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_prompt_length:
            extra = {k: v for k, v in row.items() if k not in ("prompt", "messages", "ground_truth")}
            records.append(PromptRecord(text, ids, str(row["ground_truth"]), extra))
    if not records:
        raise ValueError(f"no prompt fits data.max_prompt_length={max_prompt_length} tokens")
    return records
