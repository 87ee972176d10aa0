"""Peak activation memory per rank and update tokens/s, Ulysses sequence parallelism 1
against 2 (issue 33), on two gloo ranks on CPU.

The same update each time: two responses of ``--tokens`` tokens (prompt included) on the tiny
model (built with ``--layers`` layers and room for the length), one response per forward. With
``sequence_parallel_size=1`` each rank runs one whole response; with 2 the two ranks share
each response, each holding half of it, and run both in turn. Peak memory is each rank's
process peak resident set (``ru_maxrss``) during the updates above its resident set just
before them: activations, attention scores and the loss path (the tiny model's weights
and optimizer state are a few MB), allocator caching included; and, exactly, the bytes
autograd saves for backward in one forward (activation memory).

    python bench/sequence_parallel.py                  # 4096 tokens
    python bench/sequence_parallel.py --tokens 8192
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build_config(sp: int, tokens: int):  # -> rlframe.config.Config
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
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=1, max_prompt_length=PROMPT),
        rollout=RolloutConfig(engine="hf", n=2, max_tokens=tokens - PROMPT),
        actor=ActorConfig(
            lr=1e-4,
            mini_batch_size=2,
            micro_batch_size=1,
            pack_sequences=True,
            logprob_chunk_size=1024,
            sequence_parallel_size=sp,
        ),
        algorithm=AlgorithmConfig(kl_coef=0.0),
        trainer=TrainerConfig(total_steps=1, device="cpu", procs_per_node=2),
    )


def build_rows(tokens: int, seed: int):  # -> rlframe.core.train_batch.TrainBatch
    """One response of ``tokens - PROMPT`` tokens after a prompt of ``PROMPT``."""
    import torch

    from rlframe.core.train_batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    width = tokens - PROMPT
    return TrainBatch(
        prompt_ids=torch.randint(3, 40, (1, PROMPT), generator=g),
        prompt_mask=torch.ones(1, PROMPT, dtype=torch.long),
        response_ids=torch.randint(3, 40, (1, width), generator=g),
        response_mask=torch.ones(1, width),
        loss_mask=torch.ones(1, width),
        advantages=torch.randn(1, 1, generator=g).expand(1, width).clone(),
        old_logprobs=torch.full((1, width), -3.5),
    )


class SavedActivations:
    """Bytes autograd keeps for backward (distinct storages), the most of any one forward:
    the activation memory of a micro-batch, free of the allocator's caching."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes = 0
        self.peak = 0

    def reset(self, *_: object) -> None:
        self.seen.clear()
        self.bytes = 0

    def pack(self, tensor):  # -> torch.Tensor
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
            self.peak = max(self.peak, self.bytes)
        return tensor

    def unpack(self, tensor):  # -> torch.Tensor
        return tensor


def run_rank(rank: int, port: int, sp: int, tokens: int, model: str, steps: int, out: str):
    """One rank: a warm-up update, then ``steps`` timed updates; writes its figures."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )  # fmt: skip
    import torch
    import torch.distributed as dist

    from workers.train_worker import TrainWorker

    torch.set_num_threads(1)
    worker = TrainWorker(build_config(sp, tokens), model, "cpu")
    rows = build_rows(tokens, seed=rank)
    saved = SavedActivations()
    # The FSDP root's forward is one micro-batch's forward.
    worker.train_role.actor.model.register_forward_pre_hook(saved.reset)
    before = current_rss_bytes()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        worker.update(rows)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        metrics = worker.update(rows)
    dist.barrier()
    seconds = (time.perf_counter() - start) / steps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    figures = {
        "rank": rank,
        "peak_extra_mib": (peak - before) / 2**20,
        "saved_mib": saved.peak / 2**20,
        "update_s": seconds,
        "tokens_per_s": 2 * tokens / seconds,
        "grad_norm": metrics["actor/grad_norm"],
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(figures))


def measure(sp: int, tokens: int, model: str, steps: int) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            run_rank,
            args=(free_port(), sp, tokens, model, steps, out),
            nprocs=2,
            join=True,
            start_method="spawn",
        )
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=1)
    # Enough layers that saved activations outweigh one layer's transient buffers.
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    from rlframe.data.tiny_model import TinyModelSpec, build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp, "tiny-long"))
        build_tiny_model(
            TinyModelSpec(num_layers=args.layers, max_positions=args.tokens), Path(model)
        )
        results = {sp: measure(sp, args.tokens, model, args.steps) for sp in (1, 2)}
    print(
        f"{args.tokens} tokens per response, 2 responses per update, tiny model with "
        f"{args.layers} layers, 2 gloo ranks (CPU)"
    )
    print(
        f"{'sp':>3} {'saved activations MiB/rank':>27} {'peak extra MiB/rank':>20} "
        f"{'update s':>9} {'tokens/s':>9} {'grad_norm':>10}"
    )
    for sp, ranks in results.items():
        peak = max(r["peak_extra_mib"] for r in ranks)
        saved = max(r["saved_mib"] for r in ranks)
        seconds = max(r["update_s"] for r in ranks)
        print(
            f"{sp:>3} {saved:>27.1f} {peak:>20.0f} {seconds:>9.2f} "
            f"{2 * args.tokens / seconds:>9.0f} {ranks[0]['grad_norm']:>10.5f}"
        )
    print(json.dumps({str(k): v for k, v in results.items()}))


if __name__ == "__main__":
    main()
