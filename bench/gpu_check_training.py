"""The training-side sections of bench/gpu_check.py: rlframe's FSDP2 engine, packing,
chunked log-probs, LoRA and offload on one device. Imported by its ``main``."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlframe.core.sequence_layout import build_layout
from rlframe.core.train_batch import TrainBatch
from workers.training.dtensor_gather import full_tensor
from workers.training.fsdp import FSDPEngine, OptimizerSpec, compute_layout_logprobs
from workers.training.model_build import apply_fsdp, load_hf_model
from workers.training.token_logprobs import compute_token_logprobs

if TYPE_CHECKING:
    from gpu_check import Check, Shape


def build_model_dir(shape: Shape, root: Path) -> str:
    """A Qwen2 model of ``shape`` with random weights, saved under ``root``. Its final norm is
    scaled up so that log-probs are as peaked as a trained model's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.mlp,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)
    model.save_pretrained(root)
    return str(root)


def make_rows(shape: Shape, seed: int) -> TrainBatch:
    """Ragged rows: left-padded prompts and right-padded responses of random lengths."""
    g = torch.Generator().manual_seed(seed)
    rows, prompt, response = shape.rows, shape.prompt, shape.response
    prompt_len = torch.randint(prompt // 4, prompt + 1, (rows,), generator=g)
    response_len = torch.randint(1, response + 1, (rows,), generator=g)
    prompt_mask = (torch.arange(prompt)[None] >= prompt - prompt_len[:, None]).long()
    response_mask = (torch.arange(response)[None] < response_len[:, None]).float()
    return TrainBatch(
        prompt_ids=torch.randint(3, shape.vocab, (rows, prompt), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(3, shape.vocab, (rows, response), generator=g)
        * response_mask.long(),
        response_mask=response_mask,
        loss_mask=response_mask.clone(),
    )


def count_tokens(rows: TrainBatch) -> int:
    return int(rows.prompt_mask.sum() + rows.response_mask.sum())


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def allocated_mib(device: str) -> float | None:
    return torch.cuda.memory_allocated() / 2**20 if device == "cuda" else None


def check_update(c: Check) -> dict[str, Any]:
    """Padded rows (the default where flash-attn is missing): forward, backward, AdamW."""
    spec = OptimizerSpec(1e-6, 0.0, 1.0, 0, "constant", 100)
    if c.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    c.engine = engine = FSDPEngine(c.model_dir, c.model_cfg, spec, c.device)
    params = sum(p.numel() for p in engine.model.parameters())
    rows = make_rows(c.shape, 0)
    layout = build_layout(rows, packed=False)
    width = layout.input_ids.shape[1]
    times, norms = [], []
    for step in range(4):  # the first one warms up
        synchronize(c.device)
        start = time.perf_counter()
        out = engine.compute_token_logprobs(layout, 1.0, 1024, with_entropy=False)
        (-out.logprobs.mean()).backward()
        norm, stepped = engine.optimizer_step()
        synchronize(c.device)
        times.append(time.perf_counter() - start)
        norms.append(norm)
    seconds = sorted(times[1:])[len(times[1:]) // 2]
    tokens = count_tokens(rows)
    # 6 N per token for forward and backward, plus attention over the padded width (PaLM).
    padded = rows.prompt_ids.shape[0] * width
    flops = (6 * params + 12 * c.shape.layers * c.shape.hidden * width) * padded
    figures = {
        "params_m": round(params / 1e6, 1),
        "real_tokens": tokens,
        "padded_tokens": padded,
        "seconds_per_update": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 1),
        "grad_norms": [round(n, 5) for n in norms],
        "passed": all(torch.isfinite(torch.tensor(norms)).tolist()) and stepped,
    }
    if c.peak_flops:
        figures["mfu"] = round(flops / seconds / c.peak_flops, 4)
    if c.device == "cuda":
        figures["peak_memory_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return figures


@torch.no_grad()
def score(engine: FSDPEngine, rows: TrainBatch, packed: bool) -> torch.Tensor:
    layout = build_layout(rows, packed)
    out = engine.compute_token_logprobs(layout, 1.0, 1024, with_entropy=False)
    return layout.to_grid(out.logprobs.float()).cpu()


def check_packing(c: Check) -> dict[str, Any]:
    """Packed against padded log-probs of the checkpoint, in the compute dtype and in fp32:
    fp32 shows whether the two layouts compute the same thing, the compute dtype's own
    rounding (its padded gap to fp32) is what a bf16 packed-vs-padded gap is measured against."""
    from types import SimpleNamespace

    rows = make_rows(c.shape, 1)
    mask = rows.loss_mask.bool()
    fp32_cfg = SimpleNamespace(**{**vars(c.model_cfg), "dtype": "float32"})
    exact = FSDPEngine(c.model_dir, fp32_cfg, None, c.device)
    padded32, packed32 = score(exact, rows, False), score(exact, rows, True)
    del exact
    engine = FSDPEngine(c.model_dir, c.model_cfg, None, c.device)
    padded, packed = score(engine, rows, False), score(engine, rows, True)
    layouts = (padded - packed).abs()[mask]
    rounding = (padded - padded32).abs()[mask]
    # Another row 0 (same lengths): no other row of the pack may see it.
    ids = rows.response_ids.clone()
    ids[0] = (ids[0] + 1) % c.shape.vocab * rows.response_mask[0].long()
    other = score(engine, replace(rows, response_ids=ids), True)
    leak = float((other[1:] - packed[1:]).abs()[mask[1:]].max())
    fp32_gap = float((padded32 - packed32).abs()[mask].max())
    return {
        "fp32_max_abs_gap": fp32_gap,
        "max_abs_gap": float(layouts.max()),
        "mean_abs_gap": float(layouts.mean()),
        "padded_vs_fp32_max": float(rounding.max()),
        "padded_vs_fp32_mean": float(rounding.mean()),
        "row_isolation_max_change": leak,
        "passed": fp32_gap <= 1e-3
        and float(layouts.mean()) <= 2 * float(rounding.mean()) + 1e-5
        and leak <= 1e-6,
    }


def check_chunked_logprobs(c: Check) -> dict[str, Any]:
    """Forward and backward through a [vocab, hidden] head, all tokens at once and in chunks."""
    g = torch.Generator().manual_seed(2)
    n, shape = c.shape.logprob_tokens, c.shape
    hidden0 = torch.randn(n, shape.hidden, generator=g).to(c.device, c.dtype)
    head0 = (torch.randn(shape.vocab, shape.hidden, generator=g) * 0.05).to(c.device, c.dtype)
    targets = torch.randint(0, shape.vocab, (n,), generator=g).to(c.device)
    runs = {}
    size = min(1024, n // 4)
    for chunk in (0, size):
        hidden = hidden0.clone().requires_grad_(True)
        head = head0.clone().requires_grad_(True)
        synchronize(c.device)
        if c.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        base = allocated_mib(c.device)
        logprobs = compute_token_logprobs(hidden, head, targets, 1.0, chunk, False).logprobs
        logprobs.sum().backward()
        synchronize(c.device)
        extra = torch.cuda.max_memory_allocated() / 2**20 - base if c.device == "cuda" else None
        runs[chunk] = (logprobs.detach().float(), hidden.grad.float(), head.grad.float(), extra)
    (lp0, gh0, gw0, mem0), (lp1, gh1, gw1, mem1) = runs[0], runs[size]
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    figures = {
        "tokens": n,
        "vocab": shape.vocab,
        "chunk": size,
        "logprob_max_abs_gap": float((lp0 - lp1).abs().max()),
        "hidden_grad_rel_l2": rel(gh1, gh0),
        "head_grad_rel_l2": rel(gw1, gw0),
        "unchunked_extra_mib": None if mem0 is None else round(mem0, 1),
        "chunked_extra_mib": None if mem1 is None else round(mem1, 1),
    }
    ok = figures["hidden_grad_rel_l2"] <= 1e-2 and figures["head_grad_rel_l2"] <= 1e-2
    ok &= figures["logprob_max_abs_gap"] <= (1e-4 if c.dtype == torch.float32 else 5e-2)
    if mem0 is not None:
        ok &= mem1 <= 0.2 * mem0
    figures["passed"] = ok
    return figures


def check_lora(c: Check) -> dict[str, Any]:
    """peft adapters on every linear layer, sharded with FSDP2, two AdamW steps at lr 1e-5."""
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh

    model = load_hf_model(c.model_dir, c.model_cfg, c.device, "lm")
    peft_cfg = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
    model = get_peft_model(model, peft_cfg)
    apply_fsdp(model, init_device_mesh(c.device, (1,)), c.dtype)
    model = model.to(c.device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    named = dict(model.named_parameters())
    base_name = next(n for n in named if "base_layer" in n)
    adapter_name = next(n for n in named if "lora_B" in n)
    before = {n: full_tensor(named[n].detach()).clone() for n in (base_name, adapter_name)}
    rows = make_rows(c.shape, 3)
    layout = build_layout(rows, packed=False).to(c.device)
    probe = build_layout(make_rows(c.shape, 4), packed=False).to(c.device)
    readings = []
    for _ in range(2):
        with torch.no_grad():
            model.eval()
            readings.append(compute_layout_logprobs(model, probe, 1.0, 1024, False).logprobs)
            model.train()
        out = compute_layout_logprobs(model, layout, 1.0, 1024, False)
        (-out.logprobs.mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        model.eval()
        readings.append(compute_layout_logprobs(model, probe, 1.0, 1024, False).logprobs)
    after = {n: full_tensor(named[n].detach()) for n in (base_name, adapter_name)}
    moves = [float((b - a).abs().max()) for a, b in zip(readings, readings[1:])]
    return {
        "trainable_m": round(sum(p.numel() for p in trainable) / 1e6, 2),
        "base_unchanged": bool(torch.equal(before[base_name], after[base_name])),
        "adapter_moved": float((after[adapter_name] - before[adapter_name]).abs().max()),
        # What the LoRA receiver check must see (workers/sync/sync_probe.py MOVED_NATS).
        "logprob_move_per_step_lr1e-5": moves,
        "passed": bool(torch.equal(before[base_name], after[base_name]))
        and float((after[adapter_name] - before[adapter_name]).abs().max()) > 0,
    }


def check_offload(c: Check) -> dict[str, Any]:
    if c.device != "cuda":
        return {"skipped": "actor.offload runs on cuda only"}
    engine = c.engine
    assert engine is not None and engine.optimizer is not None, "the update section runs first"
    snapshot = {k: full_tensor(v.detach()).cpu() for k, v in engine.model.state_dict().items()}
    moments = [full_tensor(s["exp_avg"].detach()).cpu() for s in engine.optimizer.state.values()]
    resident = allocated_mib("cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.offload()
    torch.cuda.synchronize()
    offload_s, offloaded = time.perf_counter() - start, allocated_mib("cuda")
    start = time.perf_counter()
    engine.reload()
    torch.cuda.synchronize()
    reload_s, reloaded = time.perf_counter() - start, allocated_mib("cuda")
    same = all(
        torch.equal(full_tensor(v.detach()).cpu(), snapshot[k])
        for k, v in engine.model.state_dict().items()
    ) and all(
        torch.equal(full_tensor(s["exp_avg"].detach()).cpu(), m)
        for s, m in zip(engine.optimizer.state.values(), moments)
    )
    steps_on_host = all(s["step"].device.type == "cpu" for s in engine.optimizer.state.values())
    return {
        "resident_mib": round(resident, 1),
        "offloaded_mib": round(offloaded, 1),
        "reloaded_mib": round(reloaded, 1),
        "offload_s": round(offload_s, 3),
        "reload_s": round(reload_s, 3),
        "round_trip_exact": same,
        "step_counts_on_host": steps_on_host,
        "passed": same and steps_on_host and offloaded < 0.1 * resident,
    }
