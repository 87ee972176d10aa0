"""Ownership of a run directory: one live run per folder, and resumes that say what changed.

- A live run holds an exclusive ``flock`` on ``<output_dir>/.lock`` (the kernel releases it
  when the process dies, however it dies) and writes its PID there. A second run into the
  folder stops before Ray starts with one line naming that PID, and writes nothing.
- A folder whose run never finished a step (no line in ``metrics.jsonl``, no checkpoint)
  can be reused: a start that failed does not claim the folder.
- Resuming compares the config with the one the checkpoint's run was launched with: every
  changed key is printed; a change that makes the checkpoint meaningless (the model, critic
  on/off, the algorithm family, the shape or scale of LoRA adapters) stops with one line
  unless ``trainer.resume_changes=allow``.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlframe.config import Config, ConfigError
from rlframe.core.names import NEEDS_CRITIC

LOCK_FILE = ".lock"
HELD: dict[Path, int] = {}
"""Lock files this process holds (path -> fd), kept open for the life of the process."""

IGNORED_CHANGES = ("trainer.total_steps", "trainer.resume", "trainer.resume_changes")
"""Keys a resume is expected to change: not reported."""

ADAPTER_KEYS = ("rank", "alpha", "target_modules")
"""LoRA keys a checkpoint's adapters are made of: another rank or set of layers does not
load; another alpha loads as another policy (the update is scaled by alpha / rank)."""


def lock_run_dir(output_dir: str | Path) -> None:
    """Create the folder and take its lock, or raise ConfigError naming the live run's PID."""
    out = Path(output_dir).resolve()
    if out in HELD:
        return
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            "trainer.output_dir",
            f"{out} is in use by a live run (PID {holder}); wait for it to end, stop it, or "
            "choose another trainer.output_dir",
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    HELD[out] = fd


def release_run_dir(output_dir: str | Path) -> None:
    """Give up this process's lock on the folder (for a process that runs several runs one
    after another, such as a notebook or the test harness; a CLI run keeps it until exit)."""
    fd = HELD.pop(Path(output_dir).resolve(), None)
    if fd is not None:
        os.close(fd)


def never_finished_a_step(output_dir: Path) -> bool:
    """True when the folder's run logged no step and saved no checkpoint: free to reuse."""
    metrics = output_dir / "metrics.jsonl"
    logged = metrics.is_file() and metrics.read_text().strip() != ""
    checkpoints = output_dir / "checkpoints"
    saved = checkpoints.is_dir() and any(checkpoints.glob("step_*"))
    return not logged and not saved


def launch_config(run_dir: Path, step: int) -> dict[str, Any] | None:
    """The config of the launch that ran up to ``step``: the last ``config.resume_<N>.json``
    with N below ``step``, else ``config.json``; None when there is none."""
    resumes = []
    for path in run_dir.glob("config.resume_*.json"):
        found = re.fullmatch(r"config\.resume_(\d+)\.json", path.name)
        if found and int(found.group(1)) < step:
            resumes.append((int(found.group(1)), path))
    path = max(resumes)[1] if resumes else run_dir / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def family(advantage: str | None) -> str:
    return "critic-based" if advantage in NEEDS_CRITIC else "critic-free"


def list_adapter_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The adapter keys of each LoRA section that has adapters before or after the resume
    (with rank 0 on both sides, alpha and the layers are unused)."""
    keys = []
    for section in ("model.lora", "critic.lora"):
        if old.get(f"{section}.rank") or new.get(f"{section}.rank"):
            keys += [f"{section}.{key}" for key in ADAPTER_KEYS]
    return keys


def check_resume_changes(cfg: Config, checkpoint: Path, step: int) -> None:
    """Print the keys changed since the checkpoint's launch; refuse the ones that make the
    checkpoint meaningless unless ``trainer.resume_changes=allow``."""
    saved = launch_config(checkpoint.parent.parent, step + 1)
    if saved is None:
        return
    old, new = flatten(saved), flatten(json.loads(json.dumps(asdict(cfg), default=str)))
    changed = [
        k
        for k in sorted(old.keys() | new.keys())
        if old.get(k) != new.get(k) and k not in IGNORED_CHANGES
    ]
    if not changed:
        return
    fatal: list[str] = [k for k in ("model.path", "critic.enable") if k in changed]
    if family(old.get("algorithm.advantage")) != family(new.get("algorithm.advantage")):
        fatal.append("algorithm.advantage")
    fatal += [k for k in list_adapter_keys(old, new) if k in changed]
    if fatal and cfg.trainer.resume_changes != "allow":
        # One line: the refusal alone (the other changed keys are listed once it resumes).
        key = fatal[0]
        raise ConfigError(
            key,
            f"{checkpoint} was saved with {key}={old.get(key)!r}, not {new.get(key)!r}: its "
            "weights and state do not fit; resume with the old value, choose a new "
            "trainer.output_dir, or pass trainer.resume_changes=allow",
        )
    described = ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
    print(f"rlframe: resuming {checkpoint} with changed keys: {described}", file=sys.stderr)


def check_resume_processor(model_path: str, checkpoint: Path) -> None:
    """A resumed vision-language run's processor is the one its checkpoint saved (a text
    model's checkpoint has none, and passes)."""
    from rlframe.models.images import find_processor_change
    from rlframe.state.checkpoint_layout import HF_CONFIG

    change = find_processor_change(checkpoint / HF_CONFIG, model_path)
    if change is not None:
        raise ConfigError(
            "model.path",
            f"the processor of {model_path} is not the one {checkpoint} saved ({change}): "
            "resume with the model folder the run was trained with",
        )
