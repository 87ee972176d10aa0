"""Export a checkpoint's policy as a Hugging Face model: safetensors, config and tokenizer
(the command is ``python -m rlframe.export``).

CHECKPOINT is a checkpoint folder (``<run>/checkpoints/step_N``) or a run directory (its
latest checkpoint). The sharded actor state is read on this one process, whatever the world
size it was saved with, so this runs on a machine without GPUs or Ray. ``OUT_DIR`` then loads
with ``AutoModelForCausalLM.from_pretrained`` (a vision-language model with
``AutoModelForImageTextToText`` and its processor with ``AutoProcessor``) and with vLLM. A
LoRA run's checkpoint holds the adapters alone: it exports as a peft adapter folder over the
base model it was trained on (``PeftModel.from_pretrained``), or with ``--merge`` as the merged
plain model.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from rlframe.models.hf_config import pick_policy_model_class
from rlframe.models.images import save_processor
from rlframe.state.checkpoint_layout import (
    DRIVER_STATE,
    HF_CONFIG,
    LORA_BASE,
    find_latest_checkpoint,
)
from rlframe.state.checksums import find_damage


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder as given, or the latest checkpoint of a run directory; ValueError
    naming the file when it is damaged (:mod:`rlframe.state.checksums`)."""
    if not ((path / DRIVER_STATE).is_file() or (path / "actor").is_dir()):
        latest = find_latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"{path} is neither a checkpoint nor a run directory with one")
        path = latest
    damage = find_damage(path) if (path / DRIVER_STATE).is_file() else None
    if damage is not None:
        raise ValueError(f"{damage}: {path} cannot be exported")
    return path


def export_checkpoint(
    checkpoint: Path, out_dir: Path, dtype: torch.dtype = torch.float32, merge: bool = False
) -> Path:
    """Write the actor of ``checkpoint`` to ``out_dir`` as a Hugging Face model; a LoRA
    checkpoint as a peft adapter folder, or with ``merge`` as the merged model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import (
        AutoConfig,
        AutoTokenizer,
        GenerationConfig,
    )

    shards, meta_dir = checkpoint / "actor", checkpoint / HF_CONFIG
    if (meta_dir / LORA_BASE).is_file():
        return export_lora_checkpoint(checkpoint, out_dir, dtype, merge)
    config = AutoConfig.from_pretrained(meta_dir)
    model = pick_policy_model_class(config).from_config(config, dtype=torch.float32)
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
    save_processor(str(meta_dir), out_dir)
    try:
        GenerationConfig.from_pretrained(meta_dir).save_pretrained(out_dir)
    except OSError:
        pass  # the model shipped no generation config
    return out_dir


def export_lora_checkpoint(
    checkpoint: Path, out_dir: Path, dtype: torch.dtype, merge: bool
) -> Path:
    """The base model (from the path saved beside the checkpoint) with the checkpoint's
    adapters: saved as a peft adapter folder (``PeftModel.from_pretrained(base, out_dir)``),
    or merged into the base weights as a plain Hugging Face model."""
    import torch.distributed.checkpoint as dcp
    from peft import get_peft_model
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import (
        AutoConfig,
        AutoTokenizer,
        GenerationConfig,
        PreTrainedModel,
    )

    from rlframe.config.lora import LoraConfig
    from rlframe.models.lora_targets import list_peft_targets

    shards, meta_dir = checkpoint / "actor", checkpoint / HF_CONFIG
    info = json.loads((meta_dir / LORA_BASE).read_text())
    base_path = info.pop("base_model")
    auto = pick_policy_model_class(AutoConfig.from_pretrained(base_path))
    base = auto.from_pretrained(base_path, dtype=torch.float32)
    lora = LoraConfig(**info)
    model = get_peft_model(base, lora.to_peft(targets=list_peft_targets(base, lora)))
    saved = FileSystemReader(str(shards)).read_metadata().state_dict_metadata
    state = model.state_dict()
    adapters = {k: v for k, v in state.items() if "lora_" in k}
    missing = sorted(k for k in adapters if f"model.{k}" not in saved)
    if missing:
        raise KeyError(f"{shards} lacks {len(missing)} adapter tensors, e.g. {missing[:3]}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": adapters}, checkpoint_id=str(shards))
    out_dir.mkdir(parents=True, exist_ok=True)
    if merge:
        merged = model.merge_and_unload().to(dtype)
        if not isinstance(merged, PreTrainedModel):  # peft hands back the model it wrapped
            raise TypeError(f"merging the adapters gave a {type(merged).__name__}")
        merged.save_pretrained(out_dir, safe_serialization=True)
        try:
            GenerationConfig.from_pretrained(meta_dir).save_pretrained(out_dir)
        except OSError:
            pass
    else:
        model.to(dtype).save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(meta_dir).save_pretrained(out_dir)
    save_processor(str(meta_dir), out_dir)
    return out_dir
