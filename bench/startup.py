"""Start-up of a run: how long after the command step 1 begins, and what that time is made of.

Runs ``python -m rlframe.main +recipe=RECIPE trainer.total_steps=1`` several times (after one
warm-up run, so caches are warm), reads the run's own start-up line

    rlframe: step 1 began 11.6 s after the command: interpreter 0.9, config 0.5, ...

and prints the median, minimum and maximum of the total and of every phase, beside the time
this script saw between spawning the command and reading that line (a check on the run's clock).

    python bench/startup.py                 # grpo_tiny, 3 runs
    python bench/startup.py --runs 5 --recipe agent_tiny -- rollout.engine=hf
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LINE = re.compile(r"rlframe: step \d+ began ([\d.]+) s after the command: (.*)$")
PART = re.compile(r"([\w ]+?) ([\d.]+)(?: \(([^)]*)\))?(?:, |$)")


def parse_phases(text: str) -> dict[str, float]:
    """``interpreter 0.9, workers 6.1 (actor boot 2.0, ...), ...`` -> flat name -> seconds."""
    phases: dict[str, float] = {}
    for name, seconds, inner in PART.findall(text):
        phases[name.strip()] = float(seconds)
        for item in filter(None, (inner or "").split(", ")):
            sub, value = item.rsplit(" ", 1)
            phases[f"  {sub}"] = float(value)
    return phases


def run_once(recipe: str, overrides: list[str]) -> tuple[float, float, dict[str, float]]:
    """One run: (seconds this script saw, seconds the run reported, phases)."""
    out = Path(tempfile.mkdtemp(prefix="rlframe-startup-")) / "run"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = [sys.executable, "-m", "rlframe.main", f"+recipe={recipe}"]
    command += ["trainer.total_steps=1", f"trainer.output_dir={out}", *overrides]
    start = time.time()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    seen, found = 0.0, None
    for line in proc.stdout:
        if (found := LINE.search(line.strip())) is not None:
            seen = time.time() - start
            break
    _, err = proc.communicate(timeout=600)
    if found is None or proc.returncode != 0:
        raise SystemExit(f"the run failed (exit {proc.returncode}):\n{err[-3000:]}")
    return seen, float(found.group(1)), parse_phases(found.group(2))


def summarise(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} {min(values):6.2f} {max(values):6.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="grpo_tiny")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="key=value overrides, after --")
    args = parser.parse_args()
    run_once(args.recipe, args.overrides)  # warm the caches (the tiny model, bytecode, the OS's)
    runs = [run_once(args.recipe, args.overrides) for _ in range(args.runs)]
    names = list(dict.fromkeys(name for _, _, phases in runs for name in phases))
    print(f"start-up of +recipe={args.recipe} {' '.join(args.overrides)} ({args.runs} runs, warm)")
    print(f"{'seconds':<32} median    min    max")
    print(f"{'step 1 began (run clock)':<32} {summarise([r[1] for r in runs])}")
    print(f"{'step 1 line seen (this script)':<32} {summarise([r[0] for r in runs])}")
    for name in names:
        print(f"{name:<32} {summarise([r[2].get(name, 0.0) for r in runs])}")


if __name__ == "__main__":
    main()
