"""Per-rank memory of the experts and their optimizer state, and update tokens/s, of an MoE
policy on two ranks at ``actor.expert_parallel_size`` 1 and 2 (issue 44).

Two real gloo ranks (torch.multiprocessing) each build a ``TrainWorker`` on ``tiny-moe:0``
(Qwen3-MoE, 8 experts, top-2) and run ``update`` on their half of the same batch (a warm-up,
then ``--repeats`` timed). At EP 1 FSDP2 shards every expert tensor over both ranks (each
holds half of each); at EP 2 each rank holds four experts whole. Either way a rank holds half
the expert parameters and half their AdamW moments at rest. What EP changes is the forward
and backward: FSDP2 all-gathers every expert of a layer on every rank (``gathered``: one
layer's experts whole, alive while the layer runs), EP gathers none and sends tokens instead
(two all-to-alls a layer). The figures count the bytes of each rank's local tensors; peak
RSS is the rank process's.

    python bench/moe_expert_parallel.py
    python bench/moe_expert_parallel.py --rows 128 --response 48 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe_throughput import PROMPT, make_batch  # noqa: E402


def make_config(rows: int, micro: int, response: int, ep: int):
    from rlframe.config import (
        ActorConfig,
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
        actor=ActorConfig(
            lr=1e-5, mini_batch_size=rows, micro_batch_size=micro, expert_parallel_size=ep
        ),
        trainer=TrainerConfig(total_steps=100, device="cpu", procs_per_node=2),
    )


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of a (possibly FSDP2-sharded) tensor."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def measure(ep: int, args: argparse.Namespace, rank: int) -> dict[str, float]:
    from rlframe.data.tiny_model import resolve_model_path
    from workers.train_worker import TrainWorker

    worker = TrainWorker(
        make_config(args.rows, args.micro, args.response, ep),
        resolve_model_path("tiny-moe:0"),
        "cpu",
    )
    batch = make_batch(args.rows, args.response, vocab=40).chunk(2)[rank]
    worker.update(batch)  # warm-up; AdamW's moments exist from here
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        worker.update(batch)
        seconds.append(time.perf_counter() - start)
    engine = worker.train_role.actor
    assert engine.optimizer is not None
    figures = {"expert_params": 0, "expert_optim": 0, "dense_params": 0, "dense_optim": 0}
    for name, param in engine.model.named_parameters():
        kind = "expert" if ".experts." in name else "dense"
        figures[f"{kind}_params"] += local_bytes(param)
        state = engine.optimizer.state.get(param, {})
        figures[f"{kind}_optim"] += sum(
            local_bytes(v) for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")
        )
    tokens = 2 * float(batch.prompt_mask.sum() + batch.response_mask.sum())
    layers = len(
        {n.split(".experts.")[0] for n, _ in engine.model.named_parameters() if ".experts." in n}
    )
    # FSDP2 gathers a layer's experts whole for its forward (and again in the backward).
    figures["gathered"] = 0 if ep > 1 else 2 * figures["expert_params"] // layers
    return {
        **{k: v / 2**10 for k, v in figures.items()},
        "tokens_per_s": tokens / statistics.median(seconds),
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
    }


def run_rank(rank: int, port: int, ep: int, args: argparse.Namespace, out: str) -> None:
    import os

    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    )
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    Path(f"{out}.{rank}").write_text(json.dumps(measure(ep, args, rank)))


def main() -> None:
    from tests.harness import free_port

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(
        f"tiny-moe:0 on 2 gloo ranks (cpu), {args.rows} responses of {args.response // 4}-"
        f"{args.response} tokens + prompt {PROMPT}, micro-batches of {args.micro}; KiB per rank"
    )
    for ep in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "figures")
            mp.start_processes(
                run_rank,
                args=(free_port(), ep, args, out),
                nprocs=2,
                join=True,
                start_method="spawn",
            )
            for rank in range(2):
                f = json.loads(Path(f"{out}.{rank}").read_text())
                print(
                    f"  EP {ep} rank {rank}: experts {f['expert_params']:6.0f} + AdamW "
                    f"{f['expert_optim']:6.0f}  dense {f['dense_params']:6.0f} + AdamW "
                    f"{f['dense_optim']:6.0f}  gathered {f['gathered']:5.0f}  "
                    f"update {f['tokens_per_s']:6.0f} tokens/s  "
                    f"peak RSS {f['peak_mb']:5.0f} MiB",
                    flush=True,
                )
    load = os.getloadavg()
    print(f"load average (1, 5, 15 min): {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}")


if __name__ == "__main__":
    main()
