"""Export a checkpoint's policy as a Hugging Face model: safetensors, config and tokenizer.

    python -m rlframe.export CHECKPOINT OUT_DIR [--dtype bfloat16]

CHECKPOINT is a checkpoint folder (``<run>/checkpoints/step_N``) or a run directory (its
latest checkpoint). The sharded actor state is read on this one process, whatever the world
size it was saved with, so this runs on a machine without GPUs or Ray. ``OUT_DIR`` then loads
with ``AutoModelForCausalLM.from_pretrained`` and with vLLM.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

from rlframe.checkpoint_layout import DRIVER_STATE, HF_CONFIG, find_latest_checkpoint


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder as given, or the latest checkpoint of a run directory."""
    if (path / DRIVER_STATE).is_file() or (path / "actor").is_dir():
        return path
    latest = find_latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint nor a run directory with one")
    return latest


def export_checkpoint(checkpoint: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the actor of ``checkpoint`` to ``out_dir`` as a Hugging Face model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    shards, meta_dir = checkpoint / "actor", checkpoint / HF_CONFIG
    config = AutoConfig.from_pretrained(meta_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    saved = FileSystemReader(str(shards)).read_metadata().state_dict_metadata
    # The state dict's tensors are the model's own: DCP loads into them in place.
    state = model.state_dict()
    wanted = {k: v for k, v in state.items() if f"model.{k}" in saved}
    absent = sorted(set(state) - set(wanted))
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(absent) - tied:
        raise KeyError(f"{shards} lacks {len(absent)} model tensors, e.g. {absent[:3]}")
    with warnings.catch_warnings():
        # DCP warns that no process group exists: reading on one process is the intent here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": wanted}, checkpoint_id=str(shards))
    if tied:
        model.tie_weights()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(meta_dir).save_pretrained(out_dir)
    try:
        GenerationConfig.from_pretrained(meta_dir).save_pretrained(out_dir)
    except OSError:
        pass  # the model shipped no generation config
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rlframe.export", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "checkpoint", type=Path, help="a checkpoint folder, or a run directory (its latest)"
    )
    parser.add_argument("out_dir", type=Path, help="where the Hugging Face model is written")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    try:
        checkpoint = resolve_checkpoint(args.checkpoint)
        export_checkpoint(checkpoint, args.out_dir, getattr(torch, args.dtype))
    except (FileNotFoundError, KeyError) as e:
        print(f"rlframe.export: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"exported {checkpoint} -> {args.out_dir}")


if __name__ == "__main__":
    main()
