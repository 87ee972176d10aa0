"""Preflight for a local model folder: it holds weights that can be loaded.

Checked before Ray starts, so a folder with a config but no (or broken) weights fails in one
line instead of a worker traceback. Safetensors files are checked to their headers: the
header must parse and every tensor must lie inside the file (a truncated copy fails).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from rlframe.config import ConfigError

SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def check_safetensors(path: Path) -> str | None:
    """Why the file cannot be loaded, or None."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                return f"{path.name} is truncated (header of {length} bytes, file of {size})"
            header = json.loads(f.read(length))
    except (struct.error, ValueError, OSError) as e:
        return f"{path.name} is not a safetensors file ({e})"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    if ends and 8 + length + max(ends) > size:
        return f"{path.name} is truncated ({size} bytes, its tensors need {8 + length + max(ends)})"
    return None


def find_weight_files(folder: Path) -> list[Path]:
    """The weight files the folder's index names, or its single weight file; [] if none."""
    for name in INDEX_FILES:
        index = folder / name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing or not shards:
                raise ConfigError(
                    "model.path", f"{folder}: {name} names missing shards {missing[:3]}"
                )
            return [folder / s for s in shards]
    return [folder / name for name in SINGLE_FILES if (folder / name).is_file()]


def check_model_weights(folder: Path) -> None:
    """Raise ConfigError naming ``model.path`` unless ``folder`` holds loadable weights."""
    files = find_weight_files(folder)
    if not files:
        raise ConfigError(
            "model.path",
            f"{folder} has a config.json but no weights (model.safetensors, pytorch_model.bin "
            "or a sharded index): point it at a saved model folder",
        )
    for path in files:
        if path.stat().st_size == 0:
            raise ConfigError("model.path", f"{path} is empty")
        if path.suffix == ".safetensors":
            problem = check_safetensors(path)
            if problem is not None:
                raise ConfigError("model.path", f"{folder}: {problem}")
