"""A checkpoint's files and their checksums: written at save, checked before a resume.

A save lists every file of the checkpoint folder (the workers' shards and DCP ``.metadata``,
``hf_config/`` with the tokenizer and a vision-language model's processor, the export,
``driver_state.json``) in ``checksums.json`` with its size and SHA-256, after everything else
is written and before the folder is renamed into place. A resume reads the list back before
Ray starts: a file missing, cut short or changed (a copy that stopped half-way, a disk that
flipped bytes) is found by name in seconds, where loading it would fail minutes later inside
a worker, or worse, load silently. A checkpoint saved before checksums existed has no list;
only its ``driver_state.json`` is checked (it must parse).
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rlframe.state.checkpoint_layout import DRIVER_STATE

MANIFEST = "checksums.json"
CHUNK_BYTES = 1 << 22


def hash_file(path: Path) -> str:
    """The file's SHA-256 (hashlib releases the GIL on large reads: threads hash in parallel)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def list_files(folder: Path) -> list[str]:
    """Every file under ``folder`` but the list itself, as sorted relative paths."""
    found = []
    for root, _, files in os.walk(folder):
        for name in files:
            relative = os.path.relpath(os.path.join(root, name), folder)
            if relative != MANIFEST:
                found.append(relative)
    return sorted(found)


def hash_files(folder: Path, names: list[str]) -> list[str]:
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda name: hash_file(folder / name), names))


def write_manifest(folder: Path) -> None:
    """List every file of the checkpoint ``folder`` with its size and SHA-256."""
    names = list_files(folder)
    entries = {
        name: {"bytes": (folder / name).stat().st_size, "sha256": digest}
        for name, digest in zip(names, hash_files(folder, names))
    }
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def find_damage(folder: Path) -> str | None:
    """None when the checkpoint ``folder`` is whole; else what is wrong, in one phrase that
    starts with the path of the damaged file."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return check_driver_state(folder)  # saved before checksums: the driver state alone
    entries = read_manifest(manifest)
    if entries is None:
        return f"{manifest} is not the list a save writes (cut short or changed)"
    for name, entry in entries.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{path} has {size} bytes, {entry['bytes']} when saved"
    names = list(entries)
    for name, digest in zip(names, hash_files(folder, names)):
        if digest != entries[name]["sha256"]:
            return f"{folder / name} does not match its checksum (changed since the save)"
    return None


def read_manifest(manifest: Path) -> dict[str, dict[str, Any]] | None:
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
    if not isinstance(entries, dict) or not all(
        isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
        for e in entries.values()
    ):
        return None
    return entries


def check_driver_state(folder: Path) -> str | None:
    path = folder / DRIVER_STATE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return f"{path} does not parse (cut short or changed)"
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        return f"{path} holds no step"
    return None
