"""Weight-sync throughput: the cross-process broadcast against an in-process copy.

A Qwen2-architecture model of about 70M parameters (fp32, random weights, built here) is
streamed by :class:`workers.sync.weight_sync.WeightSource` in ``--bucket-mb`` buckets, either

- in-process: every bucket copied into a preallocated copy of the weights (what the
  colocated sync does before vLLM's loader takes over), or
- cross-process: broadcast by :class:`~workers.sync.weight_sync.BroadcastSender` over a gloo
  (CPU) or NCCL (GPU) :class:`~workers.sync.weight_sync.WeightGroup` to a second process whose
  :class:`~workers.sync.weight_sync.BroadcastReceiver` copies it into the same preallocated copy
  (what the separate placement does).

Both paths end with the receiver's copy equal to the source (checked), and the payload is the
same bytes, so GB/s = model bytes / seconds per sync. Prints the median of ``--repeats``.

    python bench/weight_sync.py [--device cpu|cuda] [--bucket-mb 64] [--repeats 5]

``--device cuda`` needs two GPUs: rank r runs on GPU r.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from collections.abc import Iterator

import torch
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlframe.controller.weight_group import WeightGroupSpec
from workers.sync.weight_sync import BroadcastReceiver, BroadcastSender, WeightGroup, WeightSource


def build_model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32768,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).to(device)


class CopySink:
    """Stands where the rollout engine's loader stands: copies each tensor into place."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.weights = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
        self.version = -1

    def load_weights(self, tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> None:
        for name, tensor in tensors:
            self.weights[name].copy_(tensor)
        self.version = version

    def matches(self, model: torch.nn.Module) -> bool:
        return all(torch.equal(self.weights[k], v) for k, v in model.state_dict().items())


def model_bytes(model: torch.nn.Module) -> int:
    return sum(v.numel() * v.element_size() for v in model.state_dict().values())


def time_in_process(model: torch.nn.Module, bucket_bytes: int, repeats: int) -> list[float]:
    sink = CopySink(model)
    times = []
    for version in range(repeats):
        start = time.perf_counter()
        sink.load_weights(WeightSource(model, bucket_bytes).iter_tensors(), version)
        times.append(time.perf_counter() - start)
    assert sink.matches(model), "in-process copy differs from the source"
    return times


def run_rank(rank: int, spec: WeightGroupSpec, args: argparse.Namespace, out: dict) -> None:
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(rank)  # one GPU per rank: NCCL refuses two ranks on one device
    model = build_model(args.device)
    group = WeightGroup(spec, rank, args.device)
    bucket_bytes = args.bucket_mb * 2**20
    times = []
    sink = CopySink(model) if rank == 1 else None
    for version in range(args.repeats + 1):  # the first push warms the group up
        start = time.perf_counter()
        if rank == 0:
            BroadcastSender(group).push(WeightSource(model, bucket_bytes), version)
        else:
            BroadcastReceiver(group).pull(sink)  # type: ignore[arg-type]
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if rank == 1:
        # Same seed on both sides: the received copy must equal the receiver's own model.
        out["matches"] = sink.matches(model) and sink.version == args.repeats
        out["times"] = times[1:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        parser.error(
            "--device cuda needs 2 GPUs (NCCL refuses two ranks on one GPU); "
            "bench/gpu_check.py measures the one-GPU CUDA IPC hand-off"
        )

    model = build_model(args.device)
    size = model_bytes(model)
    params = sum(p.numel() for p in model.parameters())
    local = statistics.median(time_in_process(model, args.bucket_mb * 2**20, args.repeats))
    del model

    spec = WeightGroupSpec("127.0.0.1", free_port(), 1, 1)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(run_rank, args=(spec, args, out), nprocs=2, join=True)
        assert out["matches"], "the broadcast copy differs from the source"
        remote = statistics.median(out["times"])

    gb = size / 1e9
    print(
        f"model: {params / 1e6:.1f}M parameters, {gb:.3f} GB fp32, buckets of {args.bucket_mb} MiB"
    )
    print(f"in-process copy:       {local:.3f} s per sync, {gb / local:.2f} GB/s")
    backend = "gloo" if args.device == "cpu" else "nccl"
    print(f"cross-process ({backend}): {remote:.3f} s per sync, {gb / remote:.2f} GB/s")
    print(f"cross-process / in-process time: {remote / local:.2f}x")


if __name__ == "__main__":
    main()
