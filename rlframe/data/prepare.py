"""Prompt files for the GPU recipes, made from public data sets with ``datasets``.

    python -m rlframe.data.prepare gsm8k --out data/gsm8k     # openai/gsm8k (main)
    python -m rlframe.data.prepare math --out data/math       # DigitalLearningGmbH/MATH-lighteval
    python -m rlframe.data.prepare geometry3k --out data/geo3k  # hiyouga/geometry3k (images)

Each writes ``train.parquet`` and ``test.parquet`` with the columns rlframe reads: ``prompt``
(the question plus an instruction on how to state the answer), ``ground_truth`` (the final
answer alone: GSM8K's number after ``####``, MATH's last ``\\boxed{}``) and ``data_source``,
plus ``index`` and, for MATH, ``level`` and ``type``; geometry3k rows also carry ``images``
(PNG bytes, veRL's format), which the problem's ``<image>`` marks the place of.
``--source DIR`` reads the same data from local ``train``/``test`` files (``.jsonl``, ``.json``
or ``.parquet``) in the hub's format instead of downloading it: offline machines, mirrors,
tests.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def extract_gsm8k_answer(solution: str) -> str:
    """The number after GSM8K's ``####``, without thousands separators."""
    if "####" not in solution:
        raise ValueError(f"GSM8K answer without '####': {solution[-80:]!r}")
    return solution.split("####")[-1].strip().replace(",", "")


def extract_last_boxed(solution: str) -> str:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces included."""
    start = max(solution.rfind("\\boxed"), solution.rfind("\\fbox"))
    if start < 0:
        raise ValueError(f"MATH solution without \\boxed{{}}: {solution[-80:]!r}")
    brace = solution.find("{", start)
    if brace < 0:
        raise ValueError(f"\\boxed without braces: {solution[start : start + 40]!r}")
    depth = 0
    for i in range(brace, len(solution)):
        depth += {"{": 1, "}": -1}.get(solution[i], 0)
        if depth == 0:
            return solution[brace + 1 : i].strip()
    raise ValueError(f"unbalanced braces after \\boxed: {solution[start : start + 80]!r}")


@dataclass(frozen=True)
class DataSetRecipe:
    hub_id: str
    """``datasets`` name on the Hugging Face hub."""
    config: str | None
    """The hub data set's config (subset), if it has several."""
    make_row: Callable[[dict[str, Any], int], dict[str, Any]]
    """A hub row (and its index) -> an rlframe prompt row."""


def make_gsm8k_row(row: dict[str, Any], index: int) -> dict[str, Any]:
    return {
        "prompt": f"{row['question'].strip()} {GSM8K_INSTRUCTION}",
        "ground_truth": extract_gsm8k_answer(row["answer"]),
        "data_source": "openai/gsm8k",
        "index": index,
    }


def make_math_row(row: dict[str, Any], index: int) -> dict[str, Any]:
    return {
        "prompt": f"{row['problem'].strip()} {MATH_INSTRUCTION}",
        "ground_truth": extract_last_boxed(row["solution"]),
        "data_source": "math",
        "index": index,
        "level": str(row.get("level", "")),
        "type": str(row.get("type", "")),
    }


GEOMETRY_INSTRUCTION = "Think step by step, then give the final answer within \\boxed{}."


def to_image_entry(image: Any) -> dict[str, Any]:
    """One ``images`` entry as parquet holds it: ``{"bytes", "path"}`` (a PIL image is
    encoded as PNG)."""
    if isinstance(image, dict):
        return {"bytes": image.get("bytes"), "path": image.get("path")}
    from rlframe.models.images import encode_png

    return {"bytes": encode_png(image), "path": None}


def make_geometry3k_row(row: dict[str, Any], index: int) -> dict[str, Any]:
    return {
        "prompt": f"{row['problem'].strip()} {GEOMETRY_INSTRUCTION}",
        "images": [to_image_entry(image) for image in row["images"]],
        "ground_truth": str(row["answer"]).strip(),
        "data_source": "hiyouga/geometry3k",
        "index": index,
    }


DATA_SETS = {
    "gsm8k": DataSetRecipe("openai/gsm8k", "main", make_gsm8k_row),
    "math": DataSetRecipe("DigitalLearningGmbH/MATH-lighteval", None, make_math_row),
    "geometry3k": DataSetRecipe("hiyouga/geometry3k", None, make_geometry3k_row),
}
SPLITS = ("train", "test")


def find_local_files(source: Path) -> dict[str, str]:
    """``{split: file}`` for the ``train``/``test`` files in ``source``."""
    files = {}
    for split in SPLITS:
        found = sorted(
            p for p in source.glob(f"{split}*") if p.suffix in (".jsonl", ".json", ".parquet")
        )
        if not found:
            raise ValueError(f"{source}: no {split}.jsonl, {split}.json or {split}.parquet")
        files[split] = str(found[0])
    return files


def load_splits(recipe: DataSetRecipe, source: Path | None) -> Any:
    """The data set's splits as a ``datasets.DatasetDict``, from the hub or local files."""
    import datasets

    if source is None:
        return datasets.load_dataset(recipe.hub_id, recipe.config)
    files = find_local_files(source)
    kind = "parquet" if next(iter(files.values())).endswith(".parquet") else "json"
    return datasets.load_dataset(kind, data_files=files)


def prepare(name: str, out: Path, source: Path | None = None) -> dict[str, int]:
    """Write ``out/train.parquet`` and ``out/test.parquet``; returns the rows per split."""
    if name not in DATA_SETS:
        raise ValueError(f"unknown data set {name!r}; choose from {sorted(DATA_SETS)}")
    recipe = DATA_SETS[name]
    splits = load_splits(recipe, source)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in SPLITS:
        converted = splits[split].map(
            recipe.make_row,
            with_indices=True,
            remove_columns=splits[split].column_names,
            desc=f"{name} {split}",
        )
        converted.to_parquet(str(out / f"{split}.parquet"))
        counts[split] = len(converted)
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rlframe.data.prepare", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("name", choices=sorted(DATA_SETS), help="data set to prepare")
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for train.parquet and test.parquet"
    )
    parser.add_argument(
        "--source", type=Path, default=None, help="local folder with the raw train/test files"
    )
    args = parser.parse_args(argv)
    try:
        counts = prepare(args.name, args.out, args.source)
    except (ValueError, FileNotFoundError) as e:
        print(f"rlframe.data.prepare: {e}", file=sys.stderr)
        sys.exit(2)
    print(
        f"rlframe.data.prepare: wrote {args.out}/train.parquet ({counts['train']} rows) and "
        f"{args.out}/test.parquet ({counts['test']} rows)"
    )


if __name__ == "__main__":
    main()
