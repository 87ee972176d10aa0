"""Log-probs of the same responses from three loaders of one checkpoint, one per process:

    python tests/e2e/export_logprobs.py vllm   EXPORT_DIR OUT.json   samples responses with vLLM
    python tests/e2e/export_logprobs.py hf     EXPORT_DIR IN.json OUT.json
    python tests/e2e/export_logprobs.py fsdp   CHECKPOINT IN.json OUT.json
    python tests/e2e/export_logprobs.py peft   ADAPTER_DIR IN.json OUT.json

``vllm`` loads the exported folder as any vLLM user would and samples responses with their
log-probs; ``hf`` scores them with ``AutoModelForCausalLM.from_pretrained`` of the export;
``fsdp`` scores them with the trainer's own engine (FSDP2 over gloo) loaded from the sharded
checkpoint. Separate processes, because vLLM and a torch.distributed group do not mix here.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

PROMPTS = ["1+2=", "3+4=", "0+0=", "4+1=", "2+2=", "copy ab="]
MAX_TOKENS = 4


def sample_with_vllm(export: str, out: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(export)
    llm = LLM(model=export, dtype=torch.float32, enforce_eager=True, max_model_len=64, seed=0)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    params = [
        SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, logprobs=0, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    rows = []
    for prompt, output in zip(prompts, outputs):
        c = output.outputs[0]
        rows.append(
            {
                "prompt_ids": prompt,
                "response_ids": list(c.token_ids),
                "logprobs": [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)],
            }
        )
    Path(out).write_text(json.dumps(rows))


def build_rows(samples: list[dict]):
    from rlframe.core.train_batch import TrainBatch

    width = max(len(s["prompt_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, width - len(s["prompt_ids"]) :] = torch.tensor(s["prompt_ids"])
        mask[i, width - len(s["prompt_ids"]) :] = 1
    response = torch.tensor([s["response_ids"] for s in samples])
    return TrainBatch(
        prompt_ids=ids,
        prompt_mask=mask,
        response_ids=response,
        response_mask=torch.ones_like(response),
        loss_mask=torch.ones_like(response),
    )


@torch.no_grad()
def score(model: torch.nn.Module, samples: list[dict]) -> list[list[float]]:
    """The trainer's own scoring functions (workers.training.fsdp), whatever the model."""
    from rlframe.core.sequence_layout import build_padded_layout
    from workers.training.fsdp import compute_layout_logprobs

    layout = build_padded_layout(build_rows(samples))
    return layout.to_grid(compute_layout_logprobs(model, layout, 1.0, 0, False).logprobs).tolist()


def score_with_hf(export: str, samples: list[dict]) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        export, dtype=torch.float32, attn_implementation="sdpa"
    )
    return score(model.eval(), samples)


def score_with_peft(adapter: str, samples: list[dict]) -> list[list[float]]:
    """A peft adapter folder over the base model its adapter_config.json names."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    base_path = PeftConfig.from_pretrained(adapter).base_model_name_or_path
    base = AutoModelForCausalLM.from_pretrained(
        base_path, dtype=torch.float32, attn_implementation="sdpa"
    )
    return score(PeftModel.from_pretrained(base, adapter).eval(), samples)


def score_with_fsdp(checkpoint: str, samples: list[dict]) -> list[list[float]]:
    import torch.distributed as dist

    from rlframe.config import ModelConfig
    from rlframe.data.tiny_model import resolve_model_path
    from workers.training.checkpointing import load_engine
    from workers.training.fsdp import FSDPEngine, OptimizerSpec

    # A one-process group meets through a file: a TCP port picked in advance can be taken by then.
    store = Path(tempfile.mkdtemp()) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    # The run's initial weights, then the checkpoint's state on top (what a resumed worker does).
    path = resolve_model_path("tiny:0")
    lora_file = Path(checkpoint) / "hf_config" / "lora_base.json"
    lora = None
    if lora_file.is_file():  # a LoRA run: the adapters over the base model
        from rlframe.config.lora import LoraConfig

        info = json.loads(lora_file.read_text())
        path = info.pop("base_model")
        lora = LoraConfig(**info)
    engine = FSDPEngine(
        path,
        ModelConfig(path=path),
        OptimizerSpec(1e-3, 0.0, 1.0, 0, "constant", 1),
        "cpu",
        lora=lora,
    )
    load_engine(engine, Path(checkpoint) / "actor", {"weights_version": 0})
    try:
        return score(engine.model.eval(), samples)
    finally:
        dist.destroy_process_group()


def main() -> None:
    mode, source = sys.argv[1], sys.argv[2]
    if mode == "vllm":
        sample_with_vllm(source, sys.argv[3])
        return
    samples = json.loads(Path(sys.argv[3]).read_text())
    scorers = {"hf": score_with_hf, "peft": score_with_peft, "fsdp": score_with_fsdp}
    scored = scorers[mode](source, samples)
    Path(sys.argv[4]).write_text(json.dumps(scored))


if __name__ == "__main__":
    main()
