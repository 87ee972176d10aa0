"""Update tokens/s on a length-skewed batch: packed rows in token-budget micro-batches vs
padded rows in row-count micro-batches (issue 9, benchmark b).

A real one-rank FSDP2 actor (gloo, in this process) runs ``TrainWorker.update`` on the
same batch of responses whose lengths spread from 16 to 512 tokens, most of them short
(16 + 496 u^3, u uniform), as sampled responses are. Tokens/s counts real tokens
(prompt + response) over the update's wall time (median of ``--repeats`` after a warm-up).

    python bench/update_throughput.py                        # the tiny model
    python bench/update_throughput.py --hidden 512 --layers 4  # a wider random Qwen2
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

PROMPT = 32
MAX_RESPONSE = 512


def set_single_rank_env() -> None:
    """A one-rank gloo group for this process, as a worker would have."""
    import socket

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


def build_model(hidden: int, layers: int, folder: Path) -> str:
    from rlframe.data.tiny_model import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=max(2, hidden // 64),
        intermediate_size=2 * hidden,
        max_positions=PROMPT + MAX_RESPONSE,
    )
    target = folder / f"qwen2-h{hidden}-l{layers}"
    build_tiny_model(spec, target)
    return str(target)


def make_skewed_batch(rows: int, vocab: int, seed: int = 0):
    from rlframe.core.train_batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lengths = (16 + 496 * torch.rand(rows, generator=g) ** 3).long()
    response_mask = (torch.arange(MAX_RESPONSE)[None] < lengths[:, None]).float()
    return TrainBatch(
        prompt_ids=torch.randint(3, vocab, (rows, PROMPT), generator=g),
        prompt_mask=torch.ones(rows, PROMPT, dtype=torch.long),
        response_ids=torch.randint(3, vocab, (rows, MAX_RESPONSE), generator=g)
        * response_mask.long(),
        response_mask=response_mask,
        loss_mask=response_mask,
        advantages=torch.randn(rows, 1, generator=g) * response_mask,
        old_logprobs=-3.0 * response_mask,
        rollout_logprobs=-3.0 * response_mask,
    )


def make_config(rows: int, packed: bool, micro: int, budget: int, chunk: int):
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
        rollout=RolloutConfig(engine="hf", n=2, max_tokens=MAX_RESPONSE),
        actor=ActorConfig(
            lr=1e-5,
            mini_batch_size=rows,
            micro_batch_size=micro,
            pack_sequences=packed,
            max_tokens_per_micro_batch=budget,
            logprob_chunk_size=chunk,
        ),
        algorithm=AlgorithmConfig(),
        trainer=TrainerConfig(total_steps=100, device="cpu"),
    )


def time_updates(model_path: str, batch, cfg, repeats: int) -> list[float]:
    from workers.train_worker import TrainWorker

    worker = TrainWorker(cfg, model_path, "cpu")
    worker.update(batch)  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        worker.update(batch)
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8, help="rows per padded micro-batch")
    parser.add_argument(
        "--budget",
        type=int,
        default=1024,
        help="tokens per packed micro-batch (0: micro x padded width)",
    )
    parser.add_argument(
        "--chunk", type=int, default=0, help="actor.logprob_chunk_size for both variants"
    )
    parser.add_argument("--hidden", type=int, default=0, help="0: the tiny model tiny:0")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    with tempfile.TemporaryDirectory() as tmp:
        from rlframe.data.tiny_model import resolve_model_path

        set_single_rank_env()
        path = (
            build_model(args.hidden, args.layers, Path(tmp))
            if args.hidden
            else resolve_model_path("tiny:0")
        )
        vocab = 40
        batch = make_skewed_batch(args.rows, vocab)
        real = int(batch.prompt_mask.sum() + batch.response_mask.sum())
        padded_width = PROMPT + MAX_RESPONSE
        budget = args.budget or args.micro * padded_width
        lengths = batch.response_mask.sum(1)
        print(
            f"{args.rows} responses, lengths {int(lengths.min())}-{int(lengths.max())} "
            f"(mean {float(lengths.mean()):.0f}), prompt {PROMPT}; {real} real tokens, "
            f"{args.rows * padded_width} padded; model {Path(path).name}; "
            f"threads {torch.get_num_threads()}"
        )
        variants = {
            f"padded rows, {args.micro} per micro-batch": make_config(
                args.rows, False, args.micro, 0, args.chunk
            ),
            f"packed, {budget} tokens per micro-batch": make_config(
                args.rows, True, args.micro, budget, args.chunk
            ),
        }
        rates = {}
        for name, cfg in variants.items():
            seconds = statistics.median(time_updates(path, batch, cfg, args.repeats))
            rates[name] = real / seconds
            print(f"  {name:<40} update {seconds:7.2f} s  {rates[name]:9.0f} tokens/s", flush=True)
        padded, packed = rates.values()
        print(f"packed + token budget / padded rows: {packed / padded:.2f}x tokens/s")


if __name__ == "__main__":
    main()
