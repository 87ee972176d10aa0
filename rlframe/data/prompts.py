"""Prompt data sets: parquet/jsonl files or a synthetic task, tokenised once on the driver.

A file row has ``prompt`` (text) or ``messages`` (chat turns), and ``ground_truth``; any
other columns travel along to the reward function. The tokenizer's chat template is applied
when it has one, so instruct models see prompts the way they were trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from rlframe.core.tokenizer import Tokenizer
from rlframe.data.tasks import VISUAL_TASKS, generate_examples
from rlframe.models.images import expand_prompt, load_processor, place_images, read_image_bytes


@dataclass
class PromptRecord:
    prompt: str
    """The text the model continues (after the chat template, if any)."""
    prompt_ids: list[int]
    ground_truth: str
    extra: dict[str, Any]
    """Every other column of the row, passed to the reward function."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The row's chat turns before any template: what a multi-turn env opens with, and what a
    reward model renders with its own template. Empty for synthetic tasks."""
    images: list[bytes] = field(default_factory=list)
    """The row's images (encoded bytes), in the order the prompt places them; ``prompt_ids``
    holds each image's pad already expanded to its token count."""


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a .parquet, .jsonl or .json file as dicts.

    Raises:
        ValueError: naming the file for a missing, empty, unreadable or wrongly shaped file.
    """
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    if path.suffix not in (".parquet", ".jsonl", ".json"):
        raise ValueError(f"{path}: prompt files must be .parquet, .jsonl or .json")
    try:
        rows = parse_rows(path)
    except (OSError, ValueError) as e:  # pyarrow's and json's errors are ValueError/OSError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: cannot be read as {path.suffix[1:]}: {first}") from None
    if not rows:
        raise ValueError(f"{path}: the file holds no rows")
    bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
    if bad is not None:
        raise ValueError(
            f"{path} row {bad}: a row must be an object with named columns, "
            f"got {type(rows[bad]).__name__}"
        )
    return rows


def parse_rows(path: Path) -> list[Any]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        # pyarrow ships no annotations; Table.to_pylist() returns the rows, a list of dicts.
        return cast(list[Any], pq.read_table(path).to_pylist())
    if path.suffix == ".jsonl":
        rows = []
        with path.open() as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"line {number}: {e}") from None
        return rows
    rows = json.loads(path.read_text())
    if not isinstance(rows, list):
        raise ValueError("a .json prompt file must hold a list of rows")
    return rows


def read_messages(row: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """A row's chat turns: its ``messages``, a ``prompt`` list, or a ``prompt`` text as one
    user turn."""
    if "messages" in row:
        messages: list[dict[str, Any]] = row["messages"]
        return messages
    if "prompt" in row:
        return (
            row["prompt"]
            if isinstance(row["prompt"], list)
            else [{"role": "user", "content": row["prompt"]}]
        )
    raise ValueError(f"{where}: a row needs a 'prompt' or 'messages' column; it has {sorted(row)}")


def render_prompt(row: dict[str, Any], tokenizer: Tokenizer, where: str, images: int = 0) -> str:
    """The prompt text of a row, through the chat template when the tokenizer has one (which
    must then place the row's ``images``)."""
    messages = read_messages(row, where)
    if images:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{where}: the row has images, the tokenizer no chat template")
        messages = place_images(messages, images, where)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(m["content"] for m in messages)


@dataclass
class PromptSet:
    records: list[PromptRecord]
    """The prompts that fit."""
    dropped: int
    """Prompts left out for being longer than the prompt-length limit."""


VISUAL_EXAMPLES = 1024
"""Examples of a visual task: drawing and sizing an image costs about 3 ms at start-up."""


def count_examples(task: str, synthetic_size: int) -> int:
    """How many examples of ``task`` to generate."""
    return min(synthetic_size, VISUAL_EXAMPLES) if task in VISUAL_TASKS else synthetic_size


def read_prompt_rows(
    files: list[str], task: str, seed: int, synthetic_size: int = 4096
) -> list[tuple[dict[str, Any], str]]:
    """Every row with where it came from (``file row i`` or ``task name #i``), columns checked."""
    rows: list[tuple[dict[str, Any], str]] = []
    if files:
        for name in files:
            rows += [(row, f"{name} row {i}") for i, row in enumerate(read_rows(Path(name)))]
    else:
        rows = [
            (
                {"prompt": e.prompt, "ground_truth": e.ground_truth, "task": e.task}
                | ({"images": e.images} if e.images else {}),
                f"task {task} #{i}",
            )
            for i, e in enumerate(
                generate_examples(task, count_examples(task, synthetic_size), seed)
            )
        ]
    for row, where in rows:
        if "prompt" not in row and "messages" not in row:
            raise ValueError(
                f"{where}: a row needs a 'prompt' or 'messages' column; it has {sorted(row)}"
            )
        if "ground_truth" not in row:
            raise ValueError(f"{where}: a row needs a 'ground_truth' column; it has {sorted(row)}")
    return rows


NOT_EXTRA = ("prompt", "messages", "ground_truth", "images")
"""Columns that are not passed to the reward function."""


def check_takes_images(model_path: str, where: str) -> None:
    """A row with images needs a vision-language model: say so when the model's config has
    no vision tower (a config that cannot be read here is left to the processor)."""
    from rlframe.models.hf_config import has_vision_tower, read_model_config

    config = read_model_config(model_path, False)
    if config is not None and not has_vision_tower(config):
        raise ValueError(
            f"{where}: the row has images, but the model {model_path} has no vision tower (a "
            "text-only model): use a vision-language model, or rows without images"
        )


def tokenize_prompts(
    rows: list[tuple[dict[str, Any], str]], tokenizer: Tokenizer, max_prompt_length: int
) -> PromptSet:
    """Render and tokenise every row; rows longer than ``max_prompt_length`` tokens (image
    tokens included) are counted and left out. A row with images is tokenised by the model's
    processor, which expands each image's pad to the image's tokens."""
    records = []
    for row, where in rows:
        images = [read_image_bytes(item, where) for item in row.get("images") or []]
        if images:
            check_takes_images(tokenizer.name_or_path, where)
        text = render_prompt(row, tokenizer, where, len(images))
        if images:
            ids = expand_prompt(load_processor(tokenizer.name_or_path), text, images, where)
        else:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_prompt_length:
            extra = {k: v for k, v in row.items() if k not in NOT_EXTRA}
            messages = read_messages(row, where)
            records.append(
                PromptRecord(text, ids, str(row["ground_truth"]), extra, messages, images)
            )
    return PromptSet(records, len(rows) - len(records))


def load_prompt_records(
    files: list[str],
    task: str,
    tokenizer: Tokenizer,
    max_prompt_length: int,
    seed: int,
    synthetic_size: int = 4096,
) -> list[PromptRecord]:
    """All prompts, tokenised; those longer than ``max_prompt_length`` tokens are dropped."""
    prompts = tokenize_prompts(
        read_prompt_rows(files, task, seed, synthetic_size), tokenizer, max_prompt_length
    )
    if not prompts.records:
        raise ValueError(
            f"all {prompts.dropped} prompts are longer than "
            f"data.max_prompt_length={max_prompt_length} tokens"
        )
    return prompts.records
