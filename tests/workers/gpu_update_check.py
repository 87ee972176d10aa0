"""GPU check run by tests/workers/test_gpu.py in a fresh process (its own NCCL group):
one bf16 FSDP2 update on CUDA at two micro-batch sizes; prints grad norms and peak memory."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path

import torch


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    from rlframe.data.tiny_model import resolve_model_path
    from tests.workers.cases import make_batch, make_update_config
    from workers.train_worker import TrainWorker

    path = resolve_model_path("tiny:0", cache_dir=Path(tempfile.mkdtemp()))
    norms = []
    for micro in (16, 4):
        cfg = make_update_config(micro, "token-mean", kl_coef=0.1)
        cfg.model.dtype = "bfloat16"
        torch.cuda.reset_peak_memory_stats()
        worker = TrainWorker(cfg, path, "cuda")
        metrics = worker.update(make_batch()).metrics
        norms.append(metrics["actor/grad_norm"])
        print(
            f"cuda bf16 micro={micro}: grad_norm {norms[-1]:.5f}, peak memory "
            f"{torch.cuda.max_memory_allocated() / 2**20:.1f} MiB",
            flush=True,
        )
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    # bf16 compute: the two splits agree to bf16 precision, not bit for bit.
    ok = abs(norms[0] - norms[1]) <= 2e-2 * abs(norms[0]) and norms[0] > 0
    print("micro-batch invariance (bf16):", "ok" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
