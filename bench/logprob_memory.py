"""Peak memory of the loss path, chunked vs unchunked log-probs (issue 9, benchmark a).

The loss path: final hidden states [N, H] and an LM head [V, H] -> per-token log-probs
(and entropy for logging) -> a token-mean policy-gradient loss -> backward to the hidden
states and the head. ``unchunked`` is the path before issue 9 (the whole [N, V] logits,
tempered, kept for backward, entropy over the whole vocabulary); ``chunked`` is
:func:`workers.training.token_logprobs.compute_token_logprobs` with ``--chunk`` tokens.

Each variant runs in its own process; on CPU, peak memory is the process's peak resident
set (``ru_maxrss``) and "extra" is that minus the resident set just before the loss path
(after the inputs were made). With CUDA, ``torch.cuda.max_memory_allocated`` is used.
Gradients of both variants are compared where both ran.

    python bench/logprob_memory.py                 # V in {32k, 152k}, N in {4k, 8k, 16k}
    python bench/logprob_memory.py --max-gib 12    # skip unchunked runs estimated above 12 GiB
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN = 1024
VOCABS = (32_000, 151_936)
TOKENS = (4096, 8192, 16384)


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_variant(
    variant: str, vocab: int, tokens: int, chunk: int, device: str, grads_out: str
) -> dict:
    """One measurement, in this (fresh) process."""
    import torch

    from workers.training.token_logprobs import compute_token_logprobs

    g = torch.Generator(device="cpu").manual_seed(0)
    # In place, so that making the inputs never peaks above the inputs themselves.
    hidden = torch.randn(tokens, HIDDEN, generator=g).div_(4).to(device).requires_grad_()
    head = torch.randn(vocab, HIDDEN, generator=g).div_(32).to(device).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    advantages = torch.randn(tokens, generator=g).to(device)
    temperature = 1.0
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = current_rss_bytes()
    start = time.perf_counter()
    if variant == "unchunked":
        # Before issue 9: compute_response_logits + gather_logprobs + compute_entropy(detached).
        logits = (hidden @ head.t()).float()
        logits = logits / temperature
        logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(
            logits, dim=-1
        )
        with torch.no_grad():
            logp = torch.log_softmax(logits.detach(), dim=-1)
            entropy = -(logp.exp() * logp).sum(-1)
            del logp
    else:
        out = compute_token_logprobs(hidden, head, targets, temperature, chunk, with_entropy=True)
        logprobs, entropy = out.logprobs, out.entropy
    loss = -(advantages * logprobs).mean()
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        # ru_maxrss is in KiB on Linux.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = time.perf_counter() - start
    torch.save(
        {
            "hidden": hidden.grad.cpu(),
            "head": head.grad.cpu(),
            "logprobs": logprobs.detach().cpu(),
            "entropy": entropy.cpu(),
        },
        grads_out,
    )
    inputs = (hidden.numel() + head.numel()) * 4
    return {"peak": peak, "extra": peak - base, "inputs": inputs, "seconds": seconds}


def estimate_unchunked_gib(vocab: int, tokens: int) -> float:
    """About four [N, V] fp32 buffers at the peak (logits, tempered logits, softmax, gradient)."""
    return (4 * tokens * vocab * 4 + 3 * vocab * HIDDEN * 4) / 2**30


def measure(variant: str, vocab: int, tokens: int, chunk: int, device: str, grads_out: str) -> dict:
    """Run one variant in a child process (its own peak) and return its figures."""
    env = dict(os.environ)
    # Every allocation above 64 KiB is its own mapping, given back on free: RSS follows live memory.
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    cmd = [
        sys.executable,
        __file__,
        "--child",
        variant,
        str(vocab),
        str(tokens),
        str(chunk),
        device,
        grads_out,
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(a: str, b: str) -> tuple[float, float]:
    """Largest absolute difference of the gradients (hidden states, head), and of the values
    (log-probs, entropy), between two runs."""
    import torch

    x, y = torch.load(a), torch.load(b)
    diff = {k: float((x[k] - y[k]).abs().max()) for k in x}
    return max(diff["hidden"], diff["head"]), max(diff["logprobs"], diff["entropy"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--chunk", type=int, default=1024, help="tokens per chunk (actor.logprob_chunk_size)"
    )
    parser.add_argument(
        "--max-gib", type=float, default=12.0, help="skip unchunked runs estimated above this"
    )
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--vocabs", type=int, nargs="*", default=list(VOCABS))
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, vocab, tokens, chunk, device, grads_out = args.child
        print(
            json.dumps(run_variant(variant, int(vocab), int(tokens), int(chunk), device, grads_out))
        )
        return
    print(
        f"loss-path peak memory, hidden {HIDDEN}, fp32, chunk {args.chunk} tokens, device "
        f"{args.device}"
    )
    print(
        f"{'vocab':>7} {'tokens':>6} | {'unchunked GiB':>13} {'(extra)':>8} | {'chunked GiB':>11} "
        f"{'(extra)':>8} | "
        f"{'ratio':>5} {'extra ratio':>11} | {'|grad diff|':>11} {'|value diff|':>12} | s "
        "unchunked / chunked"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in args.vocabs:
            for tokens in args.tokens:
                chunked_path, plain_path = (
                    str(Path(tmp) / "chunked.pt"),
                    str(Path(tmp) / "plain.pt"),
                )
                chunked = measure("chunked", vocab, tokens, args.chunk, args.device, chunked_path)
                if args.device == "cpu" and estimate_unchunked_gib(vocab, tokens) > args.max_gib:
                    print(
                        f"{vocab:>7} {tokens:>6} | {'skipped':>13} {'':>8} | "
                        f"{chunked['peak'] / 2**30:>11.2f} "
                        f"{chunked['extra'] / 2**30:>8.2f} | unchunked estimated at "
                        f"{estimate_unchunked_gib(vocab, tokens):.1f} GiB > --max-gib "
                        f"{args.max_gib}"
                    )
                    continue
                plain = measure("unchunked", vocab, tokens, args.chunk, args.device, plain_path)
                grad_diff, value_diff = compare(chunked_path, plain_path)
                print(
                    f"{vocab:>7} {tokens:>6} | {plain['peak'] / 2**30:>13.2f} "
                    f"{plain['extra'] / 2**30:>8.2f} | "
                    f"{chunked['peak'] / 2**30:>11.2f} {chunked['extra'] / 2**30:>8.2f} | "
                    f"{chunked['peak'] / plain['peak']:>5.2f} "
                    f"{chunked['extra'] / plain['extra']:>11.2f} | "
                    f"{grad_diff:>11.2e} {value_diff:>12.2e} | {plain['seconds']:.1f} / "
                    f"{chunked['seconds']:.1f}",
                    flush=True,
                )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
