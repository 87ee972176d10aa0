"""The ``openai`` agent's generation stage against the native agent's, on the same game.

``openai_agent_tiny`` (``recipes/agents/guess_openai.py`` through the OpenAI-compatible
endpoint) and ``agent_tiny`` (``multi_turn`` with ``guess_number``) play the same
guess-the-number game in the same shape: 16 prompts x 16 episodes, up to 4 one-character
guesses. Each is a run of ``--steps`` steps in this process, on one Ray, ``--rounds`` times
in turn (native, openai, native, ...); the figure is ``timing_s/gen``, median of steps 2 to
``--steps`` of each run, and the openai/native ratio of each round.

Beside it, where the product's functions are still there, the engine calls of each stage
(count, rows per call, seconds inside them) used to be printed; since the request stream
(issue 41) both agents send each turn as one request, and each step prints the stream's
requests and the mean requests in flight at each engine call instead.

    python bench/openai_vs_native.py [--steps 4] [--rounds 1]

For the driver's CPU per call, the endpoint's and the agents' client's apart, see
``bench/openai_endpoint.py``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent_latency import load_average, median, run_in_process, start_ray  # noqa: E402

AGENTS = {"native": "agent_tiny", "openai": "openai_agent_tiny"}


def summarise(name: str, metrics: list[dict[str, Any]]) -> float:
    """Print the run's steps, with the request stream's figures; returns its median
    ``timing_s/gen`` over steps 2 on."""
    for m in metrics:
        print(
            f"  {name} step {m['step']}: gen {m['timing_s/gen']:.2f} s, step "
            f"{m['timing_s/step']:.2f} s, reward {m['reward/mean']:.3f}; "
            f"{m.get('rollout/requests/replica_0', 0):.0f} requests, "
            f"{m.get('rollout/in_flight/replica_0', 0):.1f} in flight per engine call"
        )
    return median([m["timing_s/gen"] for m in metrics[1:]])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (step 1 is warm-up)")
    start_ray()
    print(f"openai_agent_tiny vs agent_tiny, {args.steps} steps, load {load_average()}")
    ratios = []
    with tempfile.TemporaryDirectory(prefix="openai-vs-native-") as tmp:
        for r in range(args.rounds):
            gen = {}
            for name, recipe in AGENTS.items():
                metrics = run_in_process(
                    recipe, Path(tmp) / f"{name}{r}", [f"trainer.total_steps={args.steps}"]
                )
                gen[name] = summarise(name, metrics)
            ratios.append(gen["openai"] / gen["native"])
            print(
                f"round {r + 1}: median timing_s/gen of steps 2-{args.steps}: native "
                f"{gen['native']:.2f} s, openai {gen['openai']:.2f} s: openai/native "
                f"{ratios[-1]:.2f}x (target <= 1.5x); load {load_average()}",
                flush=True,
            )
    if len(ratios) > 1:
        print(f"openai/native over {len(ratios)} rounds: {', '.join(f'{x:.2f}x' for x in ratios)}")


if __name__ == "__main__":
    main()
