"""Colocated against separate rollout placement on the same devices (the seeds' comparison).

The same recipe (``grpo_tiny`` unless told) on the same total devices: ``--ranks`` hybrid
ranks colocated against ``--ranks - 1`` trainer ranks plus one rollout rank, one CPU bundle
each. Each variant is a whole ``python -m rlframe.main`` run; figures are medians over the
steps after the first two (warm-up), from the run's stage timings:

- step time, and tokens/s (prompt + response tokens per step time);
- idle per device per step. Colocated: a rank is busy in every device stage (generation,
  log-probs, update, sync) and idle while the driver scores and computes advantages.
  Separate: a trainer rank is busy in the log-prob, update and sync stages and waits for
  generation and the driver; a rollout rank is busy generating and receiving the sync and
  waits for everything else (training included). Synchronous training, so the two pools
  take turns: this is the price that asynchronous training (the next issue) recovers.

    python bench/placement.py [--steps 12] [--ranks 2] [--recipe grpo_tiny]
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
TRAIN_STAGES = ("old_logprob", "ref", "values", "update_critic", "update", "sync")
ROLLOUT_STAGES = ("gen", "sync")


def run(overrides: list[str], recipe: str, steps: int, out: Path) -> list[dict[str, float]]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [
        sys.executable,
        "-m",
        "rlframe.main",
        f"+recipe={recipe}",
        f"trainer.total_steps={steps}",
        f"trainer.output_dir={out}",
        "trainer.loggers=[jsonl]",
        "trainer.val_every=0",
        *overrides,
    ]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines][2:]


def stage(m: dict[str, float], name: str) -> float:
    return m.get(f"timing_s/{name}", 0.0)


def summarise(metrics: list[dict[str, float]], separate: bool, ranks: int) -> dict[str, float]:
    def median(values: list[float]) -> float:
        return statistics.median(values)

    step = median([m["timing_s/step"] for m in metrics])
    train_busy = median([sum(stage(m, s) for s in TRAIN_STAGES) for m in metrics])
    gen = median([stage(m, "gen") for m in metrics])
    figures = {
        "step_s": step,
        "tokens_per_s": median([m["perf/tokens_per_s"] for m in metrics]),
        "reward_mean": median([m["reward/mean"] for m in metrics]),
    }
    if not separate:
        busy = median([stage(m, "gen") + sum(stage(m, s) for s in TRAIN_STAGES) for m in metrics])
        figures["idle_per_device_s"] = step - busy
        figures["devices"] = ranks
        return figures
    rollout_busy = median([sum(stage(m, s) for s in ROLLOUT_STAGES) for m in metrics])
    figures["trainer_idle_s"] = step - train_busy
    figures["rollout_idle_s"] = step - rollout_busy
    figures["idle_per_device_s"] = (
        (ranks - 1) * figures["trainer_idle_s"] + figures["rollout_idle_s"]
    ) / ranks
    figures["gen_s"] = gen
    figures["devices"] = ranks
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ranks", type=int, default=2, help="total CPU bundles (devices)")
    parser.add_argument("--recipe", default="grpo_tiny")
    args = parser.parse_args()
    n = args.ranks
    variants = {
        f"colocated ({n} hybrid ranks)": [f"trainer.procs_per_node={n}", "trainer.cpus_per_proc=1"],
        f"separate ({n - 1} trainer + 1 rollout)": [
            "rollout.placement=separate",
            f"trainer.procs_per_node={n - 1}",
            "trainer.cpus_per_proc=1",
            "rollout.cpus_per_proc=1",
        ],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(variants.items()):
            metrics = run(overrides, args.recipe, args.steps, Path(tmp) / str(i))
            figures = summarise(metrics, separate=i == 1, ranks=n)
            print(f"{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
