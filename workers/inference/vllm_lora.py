"""Adapter sync on the vLLM engine (``model.lora.sync=adapter``): the engine runs with LoRA
enabled over the frozen base weights it loaded at start, and each sync brings only the
adapter tensors, registered as a new adapter version (a ``LoRARequest`` with a new id) that
every later request samples from.

vLLM 0.32 loads an adapter by path, so the receiver writes the tensors it was streamed into a
peft adapter folder of its own (process-local, under a temporary directory) and registers that;
the previous version is removed once the new one is in.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlframe.config.lora import VLLM_LORA_RANKS, LoraConfig

if TYPE_CHECKING:
    from vllm import LLM
    from vllm.lora.request import LoRARequest


def pick_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``."""
    return min(r for r in VLLM_LORA_RANKS if r >= rank)


def build_lora_engine_args(lora: LoraConfig) -> dict[str, Any]:
    """``LLM(...)`` arguments that turn LoRA serving on for one adapter at a time."""
    return {"enable_lora": True, "max_lora_rank": pick_max_lora_rank(lora.rank), "max_loras": 1}


def list_target_modules(names: list[str]) -> list[str]:
    """The adapted layers' last name segments (``q_proj``), from adapter tensor names."""
    found = set()
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part.startswith("lora_") and i > 0:
                found.add(parts[i - 1])
    return sorted(found)


def write_adapter_folder(
    tensors: dict[str, torch.Tensor], lora: LoraConfig, base_model: str, dest: Path
) -> None:
    """A peft adapter folder (``adapter_model.safetensors`` + ``adapter_config.json``)."""
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, dest / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list_target_modules(list(tensors)),
        "bias": "none",
        "base_model_name_or_path": base_model,
    }
    (dest / "adapter_config.json").write_text(json.dumps(config))


class AdapterSlot:
    """The adapter version a vLLM engine serves: loads each pushed adapter under a new id,
    drops the previous one, and names the current one for requests and for errors."""

    def __init__(self, llm: LLM, lora: LoraConfig, base_model: str) -> None:
        self.llm, self.lora, self.base_model = llm, lora, base_model
        self.root = Path(tempfile.mkdtemp(prefix="rlframe-lora-"))
        self.request: LoRARequest | None = None
        self.next_id = 1

    def load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Register the streamed adapter tensors as a new adapter version."""
        from vllm.lora.request import LoRARequest

        tensors = {name: tensor.detach().cpu().clone() for name, tensor in weights}
        if not tensors:
            raise RuntimeError("adapter sync received no adapter tensors")
        lora_id, self.next_id = self.next_id, self.next_id + 1
        folder = self.root / f"v{lora_id}"
        write_adapter_folder(tensors, self.lora, self.base_model, folder)
        request = LoRARequest(f"rlframe-{lora_id}", lora_id, str(folder))
        engine = self.llm.llm_engine
        previous = self.request
        if previous is not None:
            # max_loras=1: the old adapter leaves the engine's slot before the new one enters.
            engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM refused adapter {request.lora_name} from {folder}")
        self.request = request

    def describe(self) -> str:
        if self.request is None:
            return "the base weights (no adapter loaded yet)"
        return f"adapter {self.request.lora_name} (id {self.request.lora_int_id})"

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
