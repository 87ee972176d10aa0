"""GPU readiness check: rlframe's training side on one GPU, with torch, transformers and peft
only (no Ray, no vLLM, no flash-attn), so it runs on a bare GPU machine in a few minutes.

Sections (each records its figures and whether its checks passed; the JSON is rewritten
after every section, so a run cut short still leaves what it measured):

- ``matmul_peak``: the measured bf16 matmul peak (TFLOP/s), what MFU is taken against.
- ``update``: the FSDP2 training engine (world size 1) on a Qwen2.5-0.5B-shaped model
  built from a config (random weights, no download): update tokens/s and MFU.
- ``packing``: packed against padded log-probs (sdpa), and a packed row's isolation.
- ``chunked_logprobs``: peak memory of chunked against unchunked log-probs at a 152k vocab.
- ``lora``: a LoRA update (peft) under FSDP2; only the adapters move.
- ``offload``: ``actor.offload``'s round trip of parameters and optimizer state.
- ``ipc_handoff``: a tensor handed to a second process on the same GPU (CUDA IPC), GB/s
  against a copy on the device.

    python bench/gpu_check.py --out gpu_check.json          # one GPU, a few minutes
    python bench/gpu_check.py --device cpu --tiny            # seconds; a test runs this

Exit status 1 when a section fails or a check does not pass.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

# Only torch here: the hand-off's second process re-imports this script (spawn), and
# rlframe's training side lives in gpu_check_training.py, imported by main().
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shape:
    """The model and batch sizes of a check."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    rows: int
    prompt: int
    response: int
    logprob_tokens: int
    """Tokens of the chunked log-prob check (its head has ``vocab`` rows)."""
    matmul: int
    """Side of the square matmul that measures the peak."""


QWEN05 = Shape(896, 24, 14, 2, 4864, 151936, 16, 128, 384, 16384, 8192)
"""Qwen2.5-0.5B's shape (tied embeddings), a batch of 16 rows of up to 512 tokens."""
TINY = Shape(64, 2, 4, 2, 128, 512, 6, 8, 16, 256, 256)


class Check:
    """The run's shared state and its JSON of figures."""

    def __init__(self, device: str, shape: Shape, out: Path, model_dir: str) -> None:
        self.device, self.shape, self.out, self.model_dir = device, shape, out, model_dir
        self.dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.model_cfg = SimpleNamespace(
            dtype="bfloat16" if device == "cuda" else "float32",
            trust_remote_code=False,
            gradient_checkpointing=False,
            freeze_vision=False,
        )
        self.results: dict[str, Any] = {"device": describe_device(device), "shape": asdict(shape)}
        self.peak_flops: float | None = None
        self.engine: Any = None
        """The trained engine of the update section, which the offload and packing reuse."""

    def run(self, name: str, section: Callable[[Check], dict[str, Any]]) -> None:
        start = time.perf_counter()
        try:
            figures = section(self)
        except Exception as e:  # noqa: BLE001 - recorded, and the other sections still run
            where = traceback.format_exception(e)[-6:-1]
            figures = {"passed": False, "error": f"{type(e).__name__}: {e}", "where": where}
        figures["seconds"] = round(time.perf_counter() - start, 2)
        self.results[name] = figures
        self.out.write_text(json.dumps(self.results, indent=2))
        print(f"{name}: {json.dumps(figures)}", flush=True)

    def passed(self) -> bool:
        return all(v.get("passed", True) for v in self.results.values() if isinstance(v, dict))


def describe_device(device: str) -> dict[str, Any]:
    import peft
    import transformers

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }
    if device == "cuda":
        info |= {"cuda": torch.version.cuda, "name": torch.cuda.get_device_name()}
    return info


def check_matmul_peak(c: Check) -> dict[str, Any]:
    n = c.shape.matmul
    a = torch.randn(n, n, device=c.device, dtype=c.dtype)
    b = torch.randn(n, n, device=c.device, dtype=c.dtype)
    for _ in range(3):
        a @ b
    if c.device == "cuda":
        torch.cuda.synchronize()
    repeats = 50
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if c.device == "cuda":
        torch.cuda.synchronize()
    c.peak_flops = 2 * n**3 * repeats / (time.perf_counter() - start)
    return {"tflops": round(c.peak_flops / 1e12, 4), "dtype": str(c.dtype), "size": n}


def receive_handoff(queue: Any, results: Any, device: str) -> None:
    """The second process: copies the handed-over tensor into its own memory, timed."""
    source = queue.get()
    target = torch.empty_like(source)
    times = []
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        target.copy_(source)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    results.put((sorted(times)[2], float(target.float().sum())))


def check_ipc_handoff(c: Check) -> dict[str, Any]:
    """One tensor (1 GiB on GPU) handed to a second process: CUDA IPC on the GPU (shared
    memory on CPU), copied there; GB/s against the same copy inside this process."""
    import torch.multiprocessing as mp

    elements = (2**30 if c.device == "cuda" else 2**22) // 2
    source = torch.randn(elements, device=c.device).to(torch.bfloat16)
    local = torch.empty_like(source)
    times = []
    for _ in range(5):
        if c.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        local.copy_(source)
        if c.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receive_handoff, args=(queue, results, c.device))
    proc.start()
    queue.put(source)
    remote_s, checksum = results.get(timeout=300)
    proc.join(60)
    gb = source.numel() * source.element_size() / 1e9
    local_s = sorted(times)[2]
    return {
        "gb": round(gb, 3),
        "in_process_gb_per_s": round(gb / local_s, 2),
        "handed_off_gb_per_s": round(gb / remote_s, 2),
        "passed": abs(checksum - float(source.float().sum())) <= 1e-3 * abs(checksum) + 1e-3,
    }


def join_one_rank_group(device: str) -> None:
    """This process as the only rank of a process group, as a lone worker is."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    )
    os.environ["MASTER_PORT"] = str(port)
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (seconds on CPU)")
    parser.add_argument("--out", default="gpu_check.json", help="the JSON of figures")
    parser.add_argument("--only", default="", help="comma-separated sections to run")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; use --device cpu --tiny")
    torch.set_num_threads(min(torch.get_num_threads(), 8))
    shape = TINY if args.tiny else QWEN05
    sys.path[:0] = [str(REPO), str(REPO / "bench")]
    import gpu_check_training as training

    sections: list[tuple[str, Callable[[Check], dict[str, Any]]]] = [
        ("matmul_peak", check_matmul_peak),
        ("update", training.check_update),
        ("offload", training.check_offload),
        ("packing", training.check_packing),
        ("chunked_logprobs", training.check_chunked_logprobs),
        ("lora", training.check_lora),
        ("ipc_handoff", check_ipc_handoff),
    ]
    join_one_rank_group(args.device)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as root:
        start = time.perf_counter()
        check = Check(
            args.device, shape, Path(args.out), training.build_model_dir(shape, Path(root))
        )
        check.results["model_build_s"] = round(time.perf_counter() - start, 2)
        wanted = set(filter(None, args.only.split(",")))
        for name, section in sections:
            if not wanted or name in wanted:
                check.run(name, section)
    dist.destroy_process_group()
    print("gpu_check:", "passed" if check.passed() else "FAILED", f"({args.out})", flush=True)
    return 0 if check.passed() else 1


if __name__ == "__main__":
    sys.exit(main())
