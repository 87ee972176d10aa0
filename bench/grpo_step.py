"""GRPO step time on the tiny CPU shape, before and after issue 9 (benchmark c).

The shape of the issue: 32 prompts x 8 responses x up to 32 response tokens, the tiny
Qwen2 on CPU, one rank, real vLLM. Each variant is a whole ``python -m rlframe.main`` run
of ``--steps`` steps; the figure is the median ``timing_s/step`` (and its stages) over the
steps after the first two (warm-up).

"before" runs another checkout's code, e.g. the main branch, through PYTHONPATH:

    python bench/grpo_step.py --before-code /work/main
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

SHAPE = [
    "data.batch_size=32",
    "rollout.n=8",
    "rollout.max_tokens=32",
    "actor.mini_batch_size=256",
    "actor.micro_batch_size=128",
    "trainer.val_every=0",
]
STAGES = ("gen", "old_logprob", "update", "sync", "step")
TIMINGS = tuple(f"timing_s/{stage}" for stage in STAGES)


def run(
    code: str,
    overrides: list[str],
    steps: int,
    out: Path,
    keys: tuple[str, ...] = TIMINGS,
) -> dict[str, float]:
    """One ``python -m rlframe.main`` run of ``code`` with the shape and ``overrides``: the
    median of each metric in ``keys`` over the steps after the first two (warm-up), 0 for a
    metric a step does not log."""
    env = dict(os.environ, PYTHONPATH=code)
    cmd = [
        sys.executable,
        "-m",
        "rlframe.main",
        "+recipe=grpo_tiny",
        *SHAPE,
        f"trainer.total_steps={steps}",
        f"trainer.output_dir={out}",
        *overrides,
    ]
    subprocess.run(
        cmd, env=env, check=True, cwd=code, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][2:]
    return {key: statistics.median(r.get(key, 0.0) for r in rows) for key in keys}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--before-code", default="/work/main", help="checkout whose code is 'before'"
    )
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parents[1])
    variants = {
        "before (padded rows, old-log-prob pass)": (args.before_code, []),
        "after, defaults (pass skipped)": (here, []),
        "after, packed, budget 1024, chunk 1024": (
            here,
            [
                "actor.pack_sequences=true",
                "actor.max_tokens_per_micro_batch=1024",
                "actor.logprob_chunk_size=1024",
            ],
        ),
    }
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        print(
            "GRPO step on the tiny CPU shape (32 prompts x 8 x 32 tokens), median of steps "
            f"3-{args.steps}"
        )
        print(f"{'variant':<42} " + " ".join(f"{s:>11}" for s in STAGES))
        for i, (name, (code, overrides)) in enumerate(variants.items()):
            timings = run(code, overrides, args.steps, Path(tmp) / str(i))
            results[name] = {s: timings[f"timing_s/{s}"] for s in STAGES}
            print(
                f"{name:<42} " + " ".join(f"{results[name][s]:>10.3f}s" for s in STAGES), flush=True
            )
    before = results[next(iter(variants))]["step"]
    for name, r in list(results.items())[1:]:
        print(
            f"{name}: step time {r['step'] / before:.2f}x of before ({before / r['step']:.2f}x "
            "faster)"
        )


if __name__ == "__main__":
    main()
