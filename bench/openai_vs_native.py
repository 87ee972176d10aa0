"""The ``openai`` agent's generation stage against the native agent's, on the same game.

``openai_agent_tiny`` (``recipes/agents/guess_openai.py`` through the OpenAI-compatible
endpoint) and ``agent_tiny`` (``multi_turn`` with ``guess_number``) play the same
guess-the-number game in the same shape: 16 prompts x 16 episodes, up to 4 one-character
guesses. Each is a run of ``--steps`` steps in this process, on one Ray, ``--rounds`` times
in turn (native, openai, native, ...); the figure is ``timing_s/gen``, median of steps 2 to
``--steps`` of each run, and the openai/native ratio of each round.

Beside it, where the product's functions are still there, the engine calls of each stage
(count, rows per call, seconds inside them), measured in the run: the native agent makes one
call per turn; the openai agent's requests are gathered by ``agent_server/batching.py``.

    python bench/openai_vs_native.py [--steps 4] [--rounds 1] [--per-call]

For the endpoint alone (overhead per call, sessions sustained) see ``bench/openai_endpoint.py``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent_latency import (  # noqa: E402
    Clock,
    load_average,
    median,
    multi_turn_clock,
    run_in_process,
    start_ray,
)

AGENTS = {"native": "agent_tiny", "openai": "openai_agent_tiny"}


def openai_clock() -> Clock:
    """The ``openai`` agent's stage and the batcher's engine calls."""
    from rlframe.agent_server import agent, batching

    return Clock(
        (agent, "run_openai_episodes"),
        {"engine": ((batching.GenerateBatcher, "run"), lambda batcher, group: len(group))},
    )


def summarise(
    name: str, metrics: list[dict[str, Any]], clock: Clock | None, per_call: bool
) -> float:
    """Print the run's steps; returns its median ``timing_s/gen`` over steps 2 on."""
    for m in metrics:
        line = (
            f"  {name} step {m['step']}: gen {m['timing_s/gen']:.2f} s, step "
            f"{m['timing_s/step']:.2f} s, reward {m['reward/mean']:.3f}"
        )
        if clock is not None:
            seconds, calls, rows = clock.totals(m["step"] - 1, "engine")
            line += (
                f"; {calls} engine calls, {rows / max(calls, 1):.1f} rows per call, "
                f"{seconds:.2f} s in them"
            )
            if per_call:
                each = clock.steps[m["step"] - 1]["engine"]
                line += "\n    calls (rows, s): " + ", ".join(f"{n} {t:.2f}" for t, n in each)
        print(line)
    return median([m["timing_s/gen"] for m in metrics[1:]])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--per-call", action="store_true", help="print every engine call")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (step 1 is warm-up)")
    start_ray()
    print(f"openai_agent_tiny vs agent_tiny, {args.steps} steps, load {load_average()}")
    clocks = {"native": multi_turn_clock, "openai": openai_clock}
    ratios = []
    with tempfile.TemporaryDirectory(prefix="openai-vs-native-") as tmp:
        for r in range(args.rounds):
            gen = {}
            for name, recipe in AGENTS.items():
                clock = clocks[name]()
                with clock.installed() as timed:
                    metrics = run_in_process(
                        recipe, Path(tmp) / f"{name}{r}", [f"trainer.total_steps={args.steps}"]
                    )
                gen[name] = summarise(name, metrics, clock if timed else None, args.per_call)
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
