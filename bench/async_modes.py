"""Lockstep against colocated-async and separate-async on a long-tail length task.

The task: ``grpo_tiny``'s arithmetic prompts with ``rollout.max_tokens`` raised (128 by
default), on the model of ``bench/long_tail_model.py``: most prompts are answered in a few
tokens, 12% of them run to ``max_tokens`` (the bench prints the lengths it saw). Lockstep
waits for the longest response of every step; partial rollouts pause it and train on the
groups already done.

Modes, each a whole ``python -m rlframe.main`` run on the same 2 CPUs:

- ``lockstep``: colocated, ``rollout.max_staleness=0`` (today's trainer), one rank of 2 CPUs.
- ``colocated-async``: the same rank, ``max_staleness=1`` with partial rollouts: streamed
  responses ended at the step's handoff and continued after it (``--chunk 0``, the default),
  or fixed-size calls of ``--chunk`` tokens (``rollout.partial_chunk_tokens``).
- ``separate-async``: one trainer rank and one rollout rank of 1 CPU each, ``max_staleness=1``;
  the rollout pool generates while the trainer trains.

Figures over the steps after ``--warmup``: response tokens trained per second of step time,
the trainer's and the rollout engine's idle shares (lockstep: the trainer waits for
generation and rewards, the engine for everything else; async: ``timing_s/trainer_idle``
and ``timing_s/rollout_idle``), the reward, and tokens/s against lockstep.

    python bench/async_modes.py [--steps 10] [--max-tokens 128] [--chunk 0]

``--recipe agent_tiny`` runs the multi-turn guessing game instead (the tiny model, its own
``max_tokens``; episodes run whole, so no chunk): lockstep waits for every turn's engine call
and every env step, a separate pool plays the next episodes while the trainer trains.

    python bench/async_modes.py --recipe agent_tiny --batch-size 16 --n 16 --steps 20 \
        --correction decoupled
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from long_tail_model import resolve_long_tail_model  # noqa: E402


def build_modes(args: argparse.Namespace) -> dict[str, list[str]]:
    async_keys = [
        f"rollout.max_staleness={args.staleness}",
        f"rollout.stale_groups={args.stale_groups}",
        f"algorithm.off_policy_correction={args.correction}",
    ]
    if args.recipe == "grpo_tiny":  # episodes of other agents are never cut
        async_keys.append(f"rollout.partial_chunk_tokens={args.chunk}")
    return {
        "lockstep": ["trainer.cpus_per_proc=2"],
        "colocated-async": ["trainer.cpus_per_proc=2", *async_keys],
        "separate-async": [
            "rollout.placement=separate",
            "trainer.cpus_per_proc=1",
            "rollout.cpus_per_proc=1",
            "ray.num_cpus=2",
            *async_keys,
        ],
    }


def run(overrides: list[str], args: argparse.Namespace, out: Path) -> list[dict[str, float]]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [
        sys.executable,
        "-m",
        "rlframe.main",
        f"+recipe={args.recipe}",
        f"trainer.total_steps={args.steps}",
        f"trainer.output_dir={out}",
        f"data.batch_size={args.batch_size}",
        f"rollout.n={args.n}",
        f"actor.mini_batch_size={args.batch_size * args.n}",
        f"actor.micro_batch_size={args.batch_size * args.n}",
        *overrides,
    ]
    if args.recipe == "grpo_tiny":
        cmd += [f"model.path={args.model}", f"rollout.max_tokens={args.max_tokens}"]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summarise(metrics: list[dict[str, float]], rows: int) -> dict[str, float]:
    steps = sum(m["timing_s/step"] for m in metrics)
    tokens = sum(m["response_length/mean"] * rows for m in metrics)
    if "timing_s/trainer_idle" in metrics[0]:
        trainer_idle = sum(m["timing_s/trainer_idle"] for m in metrics)
        rollout_idle = sum(m["timing_s/rollout_idle"] for m in metrics)
    else:
        trainer_idle = sum(m["timing_s/gen"] + m["timing_s/reward"] for m in metrics)
        rollout_idle = sum(m["timing_s/step"] - m["timing_s/gen"] for m in metrics)
    return {
        "tokens_per_s": tokens / steps,
        "s_per_step": steps / len(metrics),
        "trainer_idle": trainer_idle / steps,
        "rollout_idle": rollout_idle / steps,
        "reward": statistics.mean(m["reward/mean"] for m in metrics),
        "len_mean": statistics.mean(m["response_length/mean"] for m in metrics),
        "len_max": max(m["response_length/max"] for m in metrics),
        "clip": statistics.mean(m["response_length/clip_ratio"] for m in metrics),
        "staleness_max": max(m.get("off_policy/staleness_max", 0.0) for m in metrics),
        "partial_frac": statistics.mean(m.get("off_policy/partial_frac", 0.0) for m in metrics),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument(
        "--chunk", type=int, default=0, help="rollout.partial_chunk_tokens (0: streamed)"
    )
    parser.add_argument("--modes", default="lockstep,colocated-async,separate-async")
    parser.add_argument("--staleness", type=int, default=1, help="rollout.max_staleness")
    parser.add_argument("--stale-groups", default="wait", help="rollout.stale_groups")
    parser.add_argument("--model", default="", help="default: bench/long_tail_model.py's")
    parser.add_argument("--recipe", default="grpo_tiny", choices=["grpo_tiny", "agent_tiny"])
    parser.add_argument("--correction", default="recompute", help="off_policy_correction")
    args = parser.parse_args()
    if args.recipe == "grpo_tiny":
        args.model = args.model or resolve_long_tail_model()
    modes = build_modes(args)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.modes.split(","):
            metrics = run(modes[name], args, Path(tmp) / name)
            results[name] = summarise(metrics[args.warmup :], args.batch_size * args.n)
    base = results.get("lockstep", {}).get("tokens_per_s")
    print(
        f"{args.recipe}: {args.batch_size} prompts x {args.n}, "
        + (f"max_tokens {args.max_tokens}, chunk {args.chunk}, " if args.model else "")
        + f"max_staleness {args.staleness} ({args.stale_groups}),"
        f" correction {args.correction},"
        f" steps {args.warmup + 1}-{args.steps}"
    )
    header = (
        f"{'mode':<16} {'tok/s':>7} {'x lock':>6} {'s/step':>6} {'trainer idle':>12} "
        f"{'rollout idle':>12} {'reward':>6} {'len mean/max':>12} {'clip':>5} {'stale':>5} "
        f"{'partial':>7}"
    )
    print(header)
    for name, r in results.items():
        ratio = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
        print(
            f"{name:<16} {r['tokens_per_s']:7.0f} {ratio:>6} {r['s_per_step']:6.2f} "
            f"{r['trainer_idle']:12.0%} {r['rollout_idle']:12.0%} {r['reward']:6.3f} "
            f"{r['len_mean']:5.1f}/{r['len_max']:<6.0f} {r['clip']:5.2f} "
            f"{r['staleness_max']:5.0f} {r['partial_frac']:7.2f}"
        )


if __name__ == "__main__":
    main()
