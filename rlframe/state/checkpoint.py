"""Checkpoints of a whole run: atomic save, pruning, and where a run resumes from.

The folder layout is in :mod:`rlframe.state.checkpoint_layout`. A save writes everything into
``.tmp_step_N``, flushes every file and folder to disk, renames the folder to ``step_N``
(atomic on POSIX) and only then rewrites ``latest`` (itself through a temporary file and a
rename). A kill at any moment leaves the previous checkpoint whole and ``latest`` naming a
complete one; the leftover ``.tmp_*`` folder is removed by the next save. Workers write
their shards straight into the folder, so on several nodes ``output_dir`` must be on a
shared filesystem.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlframe.config import Config, ConfigError
from rlframe.config.lora import LoraConfig
from rlframe.core.tokenizer import Tokenizer
from rlframe.state.checkpoint_layout import (
    CHECKPOINTS,
    DRIVER_STATE,
    HF_CONFIG,
    HF_EXPORT,
    LATEST,
    LORA_BASE,
    RUN_FILES,
    checkpoint_name,
    find_latest_checkpoint,
    list_checkpoints,
)
from rlframe.state.checksums import find_damage, write_manifest
from rlframe.state.run_dir import check_resume_changes, never_finished_a_step
from rlframe.state.save_failures import describe_failed_save


def resolve_resume(cfg: Config) -> Path | None:
    """The checkpoint this run continues from, or None for a fresh run. Runs before Ray.

    An ``output_dir`` that already holds a run is never overwritten: with ``resume=auto`` the
    run continues from its latest checkpoint; with no checkpoint (or ``resume=never``) this
    raises a ConfigError naming the folder and the choices. A damaged checkpoint (a file
    missing, cut short or changed since the save: :mod:`rlframe.state.checksums`) is refused
    naming the file; under ``resume=auto`` the newest intact earlier one is resumed instead,
    with a warning line.
    """
    out = Path(cfg.trainer.output_dir)
    resume = cfg.trainer.resume
    if resume not in ("auto", "never"):
        path = Path(resume).expanduser()
        if not (path / DRIVER_STATE).is_file():
            raise ConfigError(
                "trainer.resume", f"{path} is not a checkpoint (it has no {DRIVER_STATE})"
            )
        damage = find_damage(path)
        if damage is not None:
            raise ConfigError("trainer.resume", f"{damage}: {path} cannot be resumed")
        return check_changes(cfg, check_seed(path, cfg.trainer.seed))
    if resume == "auto":
        latest = find_latest_checkpoint(out)
        if latest is not None:
            intact = find_intact_checkpoint(latest)
            return check_changes(cfg, check_seed(intact, cfg.trainer.seed))
    existing = [name for name in RUN_FILES if (out / name).exists()]
    if existing and never_finished_a_step(out):
        print(f"rlframe: reusing {out}: the run started there never finished a step", flush=True)
    elif existing:
        why = "no checkpoint to resume" if resume == "auto" else "trainer.resume=never"
        raise ConfigError(
            "trainer.output_dir",
            f"{out} already holds a run ({', '.join(existing)}) and {why}; choose a new "
            "trainer.output_dir, move that folder away, or resume a checkpoint "
            "(trainer.resume=auto or a path; saving needs trainer.save_every > 0)",
        )
    return None


def find_intact_checkpoint(latest: Path) -> Path:
    """``latest`` when it is whole; else the newest intact checkpoint of a lower step, with a
    warning line naming the damaged file; ConfigError naming it when there is none."""
    damage = find_damage(latest)
    if damage is None:
        return latest
    step = read_step(latest)
    for older in reversed(list_checkpoints(latest.parent)):
        if read_step(older) < step and find_damage(older) is None:
            print(
                f"rlframe: warning: {damage}; resuming from the previous intact checkpoint "
                f"{older} instead of {latest}",
                file=sys.stderr,
                flush=True,
            )
            return older
    raise ConfigError(
        "trainer.resume",
        f"{damage}: {latest} cannot be resumed and no earlier checkpoint is intact; restore "
        "the file, or choose a new trainer.output_dir",
    )


def read_step(checkpoint: Path) -> int:
    """The step of a checkpoint folder, from its name (``step_00000050``)."""
    return int(checkpoint.name.split("_")[1])


def check_changes(cfg: Config, checkpoint: Path) -> Path:
    """Print the keys changed since the checkpoint's run; refuse the fatal ones."""
    check_resume_changes(cfg, checkpoint, read_driver_state(checkpoint)["step"])
    return checkpoint


def check_seed(checkpoint: Path, seed: int) -> Path:
    """A run resumes with the seed it started with: data order and sampling derive from it."""
    saved = read_driver_state(checkpoint)["seed"]
    if saved != seed:
        raise ConfigError(
            "trainer.seed",
            f"{checkpoint} was saved by a run with trainer.seed={saved}; resume with that seed",
        )
    return checkpoint


def read_driver_state(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((path / DRIVER_STATE).read_text())
    return state


def truncate_run_logs(output_dir: Path, step: int) -> None:
    """Drop the metrics and rollouts logged after ``step`` (the resumed run logs them again),
    saying so on the console."""
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        path = output_dir / name
        if not path.is_file():
            continue
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
        if len(kept) != len(lines):
            print(
                f"rlframe: resuming at step {step}: dropped {len(lines) - len(kept)} lines of "
                f"{path} logged after it"
            )
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, path)


def fsync_tree(root: Path) -> None:
    """Flush every file and folder under ``root`` (and ``root`` itself) to disk."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(folder))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_hf_config(
    model_path: str,
    tokenizer: Tokenizer,
    dest: Path,
    trust_remote_code: bool,
    lora: LoraConfig | None = None,
) -> None:
    """The model's config (and generation config) and the tokenizer, for a later export;
    under LoRA also the adapters' settings and the base model's path, since the checkpoint
    holds the adapters alone."""
    from transformers import AutoConfig, GenerationConfig

    if lora is not None and lora.enabled:
        dest.mkdir(parents=True, exist_ok=True)
        (dest / LORA_BASE).write_text(json.dumps({"base_model": model_path, **lora.describe()}))

    AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).save_pretrained(
        dest
    )
    try:
        GenerationConfig.from_pretrained(model_path).save_pretrained(dest)
    except OSError:
        pass  # the model ships no generation config
    tokenizer.save_pretrained(dest)
    from rlframe.models.images import save_processor

    save_processor(model_path, dest, trust_remote_code)


class Checkpointer:
    """Saves checkpoints of a run and prunes old ones.

    Args:
        output_dir: the run directory.
        keep_last: complete checkpoints kept after a save.
        groups: role name -> worker group with ONE_TO_ALL ``save_checkpoint(path)``.
        write_hf_config: writes the model config and tokenizer into a folder.
        export_hf: also write a Hugging Face model into each checkpoint.
    """

    def __init__(
        self,
        output_dir: Path,
        keep_last: int,
        groups: dict[str, Any],
        write_hf_config: Callable[[Path], None],
        export_hf: bool,
    ) -> None:
        self.root = output_dir / CHECKPOINTS
        self.keep_last, self.groups = keep_last, groups
        self.write_hf_config, self.export_hf = write_hf_config, export_hf

    def save(self, step: int, driver_state: dict[str, Any]) -> Path:
        """Write checkpoint ``step`` atomically, mark it latest, prune; returns its folder."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp_*"):
            shutil.rmtree(stale)  # left by a save that was killed
        name = checkpoint_name(step)
        tmp, final = self.root / f".tmp_{name}", self.root / name
        try:
            self.write(tmp, step, driver_state)
        except Exception as e:
            raise describe_failed_save(tmp, find_latest_checkpoint(self.root.parent), e) from None
        self.replace(tmp, final)
        write_atomically(self.root / LATEST, name)
        self.prune()
        return final

    def write(self, tmp: Path, step: int, driver_state: dict[str, Any]) -> None:
        tmp.mkdir()
        for role, group in self.groups.items():
            group.save_checkpoint(str(tmp / role))
        self.write_hf_config(tmp / HF_CONFIG)
        if self.export_hf:
            from rlframe.state.export import export_checkpoint

            export_checkpoint(tmp, tmp / HF_EXPORT)
        (tmp / DRIVER_STATE).write_text(json.dumps({"step": step, **driver_state}))
        write_manifest(tmp)  # last: it lists every file above
        fsync_tree(tmp)

    def replace(self, tmp: Path, final: Path) -> None:
        """Rename ``tmp`` to ``final``; an older checkpoint of the same step (a run resumed
        from further back) is moved aside first and deleted only after the rename."""
        old = None
        if final.exists():
            old = final.with_name(f".tmp_old_{final.name}")
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(self.root)
        if old is not None:
            shutil.rmtree(old)

    def prune(self) -> None:
        """Delete all but the newest ``keep_last`` complete checkpoints (never the latest one,
        which a run resumed from further back may have given a lower step than older ones)."""
        latest = (self.root / LATEST).read_text().strip()
        complete = [p for p in list_checkpoints(self.root) if p.name != latest]
        for path in complete[: max(0, len(complete) - (self.keep_last - 1))]:
            shutil.rmtree(path)

    def load(self, path: Path) -> dict[str, Any]:
        """Load every group's shards from ``path``; returns the driver's state."""
        for role, group in self.groups.items():
            if not (path / role).is_dir():
                raise FileNotFoundError(
                    f"checkpoint {path} has no {role}/ state (was it saved with a {role}?)"
                )
            group.load_checkpoint(str(path / role))
        return read_driver_state(path)
