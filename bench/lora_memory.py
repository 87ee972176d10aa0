"""LoRA against full fine-tuning: the training step's memory and the weight-sync time.

A Qwen2-architecture model of about 113M parameters (12 layers, width 768, fp32, random
weights, the tiny model's character tokenizer) is built here once. Each mode runs in a fresh
process as one gloo rank holding the real engines, as a hybrid worker does: the FSDP2
training role (``workers.roles.train_role.TrainRole``) and the in-process vLLM rollout role.

- ``full``: full fine-tuning; the sync streams every tensor.
- ``merged``: LoRA (``--rank``, all linear layers); the sync streams the merged tensors.
- ``adapter``: LoRA; vLLM runs with LoRA on and the sync streams the adapters alone.

Per mode: the bytes of trainable parameters, gradients and AdamW moments (exact), the peak
resident memory of one training step above the process's memory before it (sampled every
2 ms), the step's time, and the median time of ``--repeats`` weight syncs (the push into
vLLM, without the receiver check, which is timed apart).

    python bench/lora_memory.py [--rank 16] [--rows 4] [--length 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

MODES = ("full", "merged", "adapter")


def build_bench_model(target: Path) -> str:
    """The 113M-parameter model, saved with the tiny model's tokenizer (built once)."""
    from transformers import Qwen2ForCausalLM

    from rlframe.data.tiny_model import (
        TinyModelSpec,
        build_tiny_config,
        build_tiny_tokenizer,
        save_model_atomically,
    )

    if (target / "config.json").exists():
        return str(target)
    spec = TinyModelSpec(
        hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12, intermediate_size=3072
    )
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(build_tiny_config(spec, tokenizer, tie_word_embeddings=True))
    save_model_atomically(model, tokenizer, target)
    return str(target)


def read_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    """Peak resident memory while the block runs (a thread reads /proc every 2 ms)."""

    def __enter__(self) -> PeakSampler:
        self.start = self.peak = read_rss()
        self.running = True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, read_rss())
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, read_rss())


def make_config(mode: str, rank: int, length: int, rows: int):
    from rlframe.config import (
        ActorConfig,
        Config,
        DataConfig,
        ModelConfig,
        RolloutConfig,
        TrainerConfig,
    )
    from rlframe.config.lora import LoraConfig

    lora = LoraConfig(rank=0 if mode == "full" else rank, alpha=2 * rank, sync=mode)
    if mode == "full":
        lora.sync = "merged"
    return Config(
        model=ModelConfig(path="bench", lora=lora),
        data=DataConfig(batch_size=rows // 2, max_prompt_length=length // 2),
        rollout=RolloutConfig(
            engine="vllm", n=2, max_tokens=length // 2, cpu_kv_cache_gb=1, weight_sync_bucket_mb=64
        ),
        actor=ActorConfig(lr=1e-4, mini_batch_size=rows, micro_batch_size=rows),
        trainer=TrainerConfig(total_steps=1, device="cpu"),
    )


def make_batch(rows: int, length: int, vocab: int):
    from rlframe.core.train_batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    half = length // 2
    mask = torch.ones(rows, half)
    return TrainBatch(
        prompt_ids=torch.randint(3, vocab, (rows, half), generator=g),
        prompt_mask=torch.ones(rows, half, dtype=torch.long),
        response_ids=torch.randint(3, vocab, (rows, half), generator=g),
        response_mask=mask,
        loss_mask=mask.clone(),
        advantages=torch.randn(rows, 1, generator=g) * mask,
    )


def measure_mode(mode: str, model_path: str, rank: int, rows: int, length: int, repeats: int):
    """One mode in this process: state bytes, the step's peak memory and time, sync times."""
    import torch.distributed as dist

    from workers.roles.rollout_role import RolloutRole
    from workers.roles.train_role import TrainRole
    from workers.sync.weight_sync import InProcessSink

    # One rank, with the environment a worker has (vLLM's external launcher reads it).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    dist.init_process_group("gloo")
    cfg = make_config(mode, rank, length, rows)
    train = TrainRole(cfg, model_path, "cpu", 1)
    model = train.actor.model
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    batch = make_batch(rows, length, int(model.config.vocab_size))
    train.update(batch)  # warm-up: allocator, AdamW moments
    with PeakSampler() as peak:
        start = time.perf_counter()
        train.update(batch)
        step_s = time.perf_counter() - start
    moments = sum(
        t.numel() * t.element_size()
        for state in train.actor.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    rollout = RolloutRole(cfg, model_path, "cpu", 0)
    sink = InProcessSink(rollout)
    sent = sum(t.numel() * t.element_size() for _, t in train.weight_source().iter_tensors())
    times = []
    for version in range(1, repeats + 1):
        start = time.perf_counter()
        sink.push(train.weight_source(), version)  # gather (and merge), then the engine's load
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    rollout.verify_weights(train.compute_sync_probe())
    probe_s = time.perf_counter() - start
    return {
        "mode": mode,
        "params_M": params / 1e6,
        "trainable_M": trainable / 1e6,
        "state_MB": (trainable * 4 * 2 + moments) / 2**20,  # trainable params + grads + moments
        "step_peak_MB": (peak.peak - peak.start) / 2**20,
        "step_s": step_s,
        "sync_s": statistics.median(times),
        "sync_MB": sent / 2**20,
        "probe_s": probe_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:  # a child: one mode, one JSON line
        os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        result = measure_mode(
            args.mode, args.model, args.rank, args.rows, args.length, args.repeats
        )
        print("RESULT " + json.dumps(result))
        return
    from rlframe.data.tiny_model import default_cache_dir

    model = build_bench_model(default_cache_dir() / "bench-qwen2-113m")
    print(f"model {model}; rank {args.rank}, {args.rows} rows x {args.length} tokens")
    print(
        f"{'mode':8} {'params':>8} {'trainable':>10} {'state MB':>9} {'step peak MB':>13} "
        f"{'step s':>7} {'sync MB':>8} {'sync s':>7} {'probe s':>8}"
    )
    for mode in MODES:
        cmd = [sys.executable, __file__, "--mode", mode, "--model", model]
        cmd += ["--rank", str(args.rank), "--rows", str(args.rows)]
        cmd += ["--length", str(args.length), "--repeats", str(args.repeats)]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{mode}: failed\n{out.stderr[-3000:]}")
            continue
        r = json.loads(line[len("RESULT ") :])
        print(
            f"{mode:8} {r['params_M']:7.1f}M {r['trainable_M']:9.2f}M {r['state_MB']:9.1f} "
            f"{r['step_peak_MB']:13.1f} {r['step_s']:7.2f} {r['sync_MB']:8.1f} "
            f"{r['sync_s']:7.3f} {r['probe_s']:8.3f}"
        )


if __name__ == "__main__":
    main()
