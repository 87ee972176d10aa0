"""Whether two model folders share a tokenizer, read from their ``tokenizer.json`` files
(no transformers import: preflight runs it before Ray)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlframe.config import ConfigError


def read_vocab(path: str) -> dict[str, Any] | None:
    """The token -> id map (added tokens included) of the folder at ``path``, or None where
    there is no local ``tokenizer.json`` to read (a hub id, a tiny model not built yet)."""
    file = Path(path).expanduser() / "tokenizer.json"
    if not file.is_file():
        return None
    tokenizer = json.loads(file.read_text())
    vocab = dict(tokenizer.get("model", {}).get("vocab", {}))
    vocab |= {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}
    return vocab


def check_same_vocab(student: str, teacher: str, key: str) -> None:
    """Refuse a teacher (at ``key``) whose token ids mean other text than the student's:
    its log-prob of a sampled id would score another token (cross-tokenizer distillation is
    not built)."""
    ours, theirs = read_vocab(student), read_vocab(teacher)
    if ours is None or theirs is None or ours == theirs:
        return
    differ = (
        sorted(t for t in ours.keys() ^ theirs.keys())[:3]
        or sorted(t for t in ours if ours[t] != theirs[t])[:3]
    )
    raise ConfigError(
        key,
        f"{teacher}'s tokenizer differs from the student's ({student}; e.g. {differ}): a "
        "teacher must share the student's token ids (cross-tokenizer distillation is not "
        "supported)",
    )
