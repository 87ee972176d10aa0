"""Host waits and time of routing replay's hooks (issue 45, desk item 8).

Routing replay (``algorithm.router_replay=rollout``) puts a forward hook on every MoE router.
Each operation of a hook that needs the device's values on the host (``.item()``, a
boolean-mask index, a copy of the host's routing) stalls a GPU's queue, once per layer in the
forward and again in the backward's recomputation under gradient checkpointing. This counts
them on ``tiny-moe:0`` (2 MoE layers) in a forward + backward with gradient checkpointing, as
a CPU sees them (tests/host_syncs.py), and times the step (median of ``--repeats``), with and
without replay. On a CPU a wait costs nothing: the figure that carries to a GPU is the count.

    python bench/router_replay_syncs.py
    python bench/router_replay_syncs.py --rows 16 --length 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from transformers import AutoModelForCausalLM

    from rlframe.data.tiny_model import resolve_model_path
    from tests.host_syncs import counting_in_hooks
    from workers.model_hooks.router_replay import RouterReplay, RoutingRecorder

    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-moe:0"))
    model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train()
    ids = torch.randint(3, 52, (args.rows, args.length))
    recorder = RoutingRecorder(model)
    with torch.no_grad():
        model(input_ids=ids)
    target = recorder.take()
    recorder.remove()
    replay = RouterReplay(model)

    def step(replayed: bool) -> float:
        start = time.perf_counter()
        with replay.replaying(target if replayed else None):
            model(input_ids=ids).logits.float().mean().backward()
        replay.take_agreement()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    layers = len(replay.routers)
    with counting_in_hooks(replay.routers, copies_of=torch.int16) as counter:
        step(True)
    print(
        f"tiny-moe:0, {layers} MoE layers, {args.rows} x {args.length} tokens, forward + "
        f"checkpointed backward; load {os.getloadavg()[0]:.1f}"
    )
    print(f"host waits in the replay hooks per step: {counter.total} {dict(counter.counts)}")
    for replayed in (False, True):
        step(replayed)  # warm-up
        times = [step(replayed) for _ in range(args.repeats)]
        print(
            f"replay {'on ' if replayed else 'off'}: {statistics.median(times) * 1e3:.1f} ms a "
            f"step (median of {args.repeats}; load {os.getloadavg()[0]:.1f})"
        )


if __name__ == "__main__":
    main()
