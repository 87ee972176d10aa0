"""Where a run's checkpoints live and which of them is the latest: names shared by the
saver (:mod:`rlframe.state.checkpoint`) and the exporter (:mod:`rlframe.state.export`).

Layout of ``<trainer.output_dir>/checkpoints/``::

    step_00000050/
        actor/              every actor rank's shards (torch.distributed.checkpoint)
        critic/             the critic's, when there is one
        driver_state.json   step, experience (prompt loader), KL controller, tracker, seeds
        checksums.json      every other file's size and SHA-256 (rlframe.state.checksums)
        hf_config/          model config and tokenizer, so an export needs nothing else
                            (under LoRA: lora_base.json, the base model and adapter settings)
        hf/                 a Hugging Face model, with trainer.export_hf=true
    latest                  the name of the newest complete checkpoint
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINTS = "checkpoints"
LATEST = "latest"
DRIVER_STATE = "driver_state.json"
HF_CONFIG = "hf_config"
LORA_BASE = "lora_base.json"
"""In ``hf_config/`` of a LoRA run: the base model's path and the adapters' settings."""
HF_EXPORT = "hf"
RUN_FILES = ("metrics.jsonl", "rollouts.jsonl", "config.json", CHECKPOINTS)


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root`` (a ``checkpoints`` folder), oldest first."""
    found = [p for p in root.glob("step_*") if (p / DRIVER_STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def find_latest_checkpoint(output_dir: Path) -> Path | None:
    """The checkpoint ``latest`` names, or the newest complete one when the marker is gone."""
    root = output_dir / CHECKPOINTS
    marker = root / LATEST
    if marker.is_file():
        named = root / marker.read_text().strip()
        if (named / DRIVER_STATE).is_file():
            return named
    complete = list_checkpoints(root)
    return complete[-1] if complete else None
