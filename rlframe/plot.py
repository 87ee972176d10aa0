"""Curves of a run, without wandb: ``python -m rlframe.plot RUN_DIR [--out FILE.png]``.

Reads ``RUN_DIR/metrics.jsonl`` and draws one panel each for the reward (training, its rule
and reward-model parts, validation), the response length, the KL terms, the entropy and the
time per stage, into ``RUN_DIR/curves.png`` unless ``--out`` says otherwise. A metric the run
did not log is left out; a panel with none of its metrics says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

PANELS: list[tuple[str, list[str]]] = [
    ("reward", ["reward/mean", "reward/rule_mean", "reward/model_mean", "val/reward/mean"]),
    ("response length (tokens)", ["response_length/mean", "response_length/max"]),
    ("KL", ["actor/kl", "actor/reward_kl", "mismatch/kl"]),
    ("entropy", ["actor/entropy"]),
]
STAGE_PREFIX = "timing_s/"


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(
            f"{run_dir}: no metrics.jsonl (is it a run directory with the jsonl logger on?)"
        )
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no steps logged yet")
    return rows


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that logged ``key``."""
    points = [(int(r["step"]), float(r[key])) for r in rows if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def stage_keys(rows: list[dict[str, Any]]) -> list[str]:
    """Every ``timing_s/<stage>`` the run logged, in first-seen order, the whole step last."""
    keys: dict[str, None] = {}
    for r in rows:
        keys |= {k: None for k in r if k.startswith(STAGE_PREFIX)}
    stages = [k for k in keys if k != f"{STAGE_PREFIX}step"]
    return stages + ([f"{STAGE_PREFIX}step"] if f"{STAGE_PREFIX}step" in keys else [])


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Draw the run's curves into a PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = read_metrics(run_dir)
    panels = [*PANELS, ("time per stage (s)", stage_keys(rows))]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.6 * len(panels)), sharex=True)
    for ax, (title, keys) in zip(axes, panels):
        drawn = 0
        for key in keys:
            steps, values = series(rows, key)
            if steps:
                style = "o-" if key.startswith("val/") else "-"
                ax.plot(
                    steps,
                    values,
                    style,
                    label=key.removeprefix(STAGE_PREFIX),
                    markersize=3,
                    linewidth=1.2,
                )
                drawn += 1
        ax.set_title(title, loc="left", fontsize=10)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8, loc="best", ncol=min(4, drawn))
        else:
            ax.text(
                0.5,
                0.5,
                "not logged by this run",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="gray",
            )
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(str(run_dir), fontsize=10)
    fig.tight_layout()
    target = out or run_dir / "curves.png"
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rlframe.plot", description="Draw a run's curves into a PNG."
    )
    parser.add_argument("run_dir", type=Path, help="the run's trainer.output_dir")
    parser.add_argument(
        "--out", type=Path, default=None, help="PNG to write (default RUN_DIR/curves.png)"
    )
    args = parser.parse_args(argv)
    try:
        target = plot_run(args.run_dir, args.out)
    except ValueError as e:
        print(f"rlframe.plot: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"rlframe.plot: wrote {target}")


if __name__ == "__main__":
    main()
