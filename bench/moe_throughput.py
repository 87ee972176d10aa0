"""Update tokens/s and peak memory of the tiny mixture-of-experts model against the dense tiny
model of the same active parameters (issue 31).

``tiny-moe:0`` (Qwen3-MoE, 8 experts of width 128, top-2) routes each token through two
experts: 2 x 128 of MLP width, as ``tiny:0``'s one MLP of width 256 (Qwen2), with the same
attention and embeddings (rlframe/data/tiny_model.py). A real one-rank FSDP2 actor (gloo, in
a fresh process per model, so each peak is its own) runs ``TrainWorker.update`` on the same
batch; tokens/s counts real tokens (prompt + response) over the update's wall time (median
of ``--repeats`` after a warm-up). Memory: the process's peak resident set (CPU) or
``torch.cuda.max_memory_allocated`` (GPU), and its growth from before the first update.

    python bench/moe_throughput.py
    python bench/moe_throughput.py --rows 256 --response 64 --aux 0.001
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

PROMPT = 16
MODELS = ("tiny:0", "tiny-moe:0")


def make_batch(rows: int, response: int, vocab: int, seed: int = 0):
    """``rows`` responses of lengths between a quarter of ``response`` and all of it."""
    from rlframe.core.train_batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(response // 4, response + 1, (rows,), generator=g)
    mask = (torch.arange(response)[None] < lengths[:, None]).float()
    return TrainBatch(
        prompt_ids=torch.randint(3, vocab, (rows, PROMPT), generator=g),
        prompt_mask=torch.ones(rows, PROMPT, dtype=torch.long),
        response_ids=torch.randint(3, vocab, (rows, response), generator=g) * mask.long(),
        response_mask=mask,
        loss_mask=mask,
        advantages=torch.randn(rows, 1, generator=g) * mask,
        old_logprobs=-3.0 * mask,
    )


def make_config(rows: int, micro: int, response: int, aux: float, device: str):
    from rlframe.config import (
        ActorConfig,
        AlgorithmConfig,
        Config,
        DataConfig,
        ModelConfig,
        RolloutConfig,
        TrainerConfig,
    )

    return Config(
        model=ModelConfig(path="unused"),
        data=DataConfig(batch_size=rows // 2, max_prompt_length=PROMPT),
        rollout=RolloutConfig(engine="hf", n=2, max_tokens=response),
        actor=ActorConfig(lr=1e-5, mini_batch_size=rows, micro_batch_size=micro),
        algorithm=AlgorithmConfig(router_aux_loss_coef=aux),
        trainer=TrainerConfig(total_steps=100, device=device),
    )


def rss_bytes() -> int:
    """This process's resident set now (Linux)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def measure(model: str, args: argparse.Namespace) -> dict[str, float]:
    """One model's update figures, in this process."""
    from bench.update_throughput import set_single_rank_env
    from rlframe.data.tiny_model import resolve_model_path
    from workers.train_worker import TrainWorker

    set_single_rank_env()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = resolve_model_path(model)
    batch = make_batch(args.rows, args.response, vocab=40)
    worker = TrainWorker(
        make_config(args.rows, args.micro, args.response, args.aux, device), path, device
    )
    params = sum(p.numel() for p in worker.train_role.actor.model.parameters())
    resting = rss_bytes()
    worker.update(batch)  # warm-up
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        worker.update(batch)
        seconds.append(time.perf_counter() - start)
    real = float(batch.prompt_mask.sum() + batch.response_mask.sum())
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
        growth = peak
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        growth = peak - resting
    update_s = statistics.median(seconds)
    return {
        "params": params,
        "update_s": update_s,
        "tokens_per_s": real / update_s,
        "peak_mb": peak / 2**20,
        "growth_mb": growth / 2**20,
        "tokens": real,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--response", type=int, default=48)
    parser.add_argument("--aux", type=float, default=0.0, help="algorithm.router_aux_loss_coef")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", help=argparse.SUPPRESS)  # the child's one model
    args = parser.parse_args()
    if args.model:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
        print(json.dumps(measure(args.model, args)))
        return
    print(
        f"{args.rows} responses of {args.response // 4}-{args.response} tokens + prompt "
        f"{PROMPT}, micro-batches of {args.micro}, router_aux_loss_coef {args.aux}, "
        f"{'cuda' if torch.cuda.is_available() else 'cpu'}"
    )
    repo = Path(__file__).resolve().parents[1]
    env = os.environ | {"PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    figures = {}
    for model in MODELS:
        child = [sys.executable, __file__, "--model", model, *sys.argv[1:]]
        out = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
        figures[model] = json.loads(out.stdout.strip().splitlines()[-1])
        f = figures[model]
        print(
            f"  {model:<11} {f['params'] / 1e6:5.2f} M params  update {f['update_s']:6.2f} s  "
            f"{f['tokens_per_s']:8.0f} tokens/s  peak {f['peak_mb']:7.0f} MiB "
            f"(+{f['growth_mb']:.0f} MiB in the updates)",
            flush=True,
        )
    dense, moe = (figures[m] for m in MODELS)
    print(
        f"tiny-moe / tiny: {moe['tokens_per_s'] / dense['tokens_per_s']:.2f}x tokens/s, "
        f"{moe['peak_mb'] / dense['peak_mb']:.2f}x peak memory"
    )


if __name__ == "__main__":
    main()
