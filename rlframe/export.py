"""Export a checkpoint's policy as a Hugging Face model: safetensors, config and tokenizer.

    python -m rlframe.export CHECKPOINT OUT_DIR [--dtype bfloat16] [--merge]

CHECKPOINT is a checkpoint folder (``<run>/checkpoints/step_N``) or a run directory (its
latest checkpoint). The work is :mod:`rlframe.state.export`'s; this module is the command.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from rlframe.state.export import export_checkpoint, resolve_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rlframe.export", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "checkpoint", type=Path, help="a checkpoint folder, or a run directory (its latest)"
    )
    parser.add_argument("out_dir", type=Path, help="where the Hugging Face model is written")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--merge",
        action="store_true",
        help="LoRA runs: merge the adapters into the base weights (a plain HF model) instead "
        "of writing a peft adapter folder",
    )
    args = parser.parse_args(argv)
    try:
        checkpoint = resolve_checkpoint(args.checkpoint)
        export_checkpoint(checkpoint, args.out_dir, getattr(torch, args.dtype), args.merge)
    except (FileNotFoundError, KeyError, ValueError) as e:
        print(f"rlframe.export: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"exported {checkpoint} -> {args.out_dir}")


if __name__ == "__main__":
    main()
