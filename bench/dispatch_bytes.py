"""Bytes per step shipped to the workers, before and after send-only-what-is-read.

A real ``grpo_tiny`` run (the quickstart shape, one hybrid rank, real vLLM) for a few steps.
Every worker-group call is measured as it is submitted: the pickled size of its arguments
as they are given (the whole Batch, text columns and all: what every dispatch shipped
before) and after the method's ``reads`` selection (what ships now). Both are summed per
step and printed, per method and in total.

    python bench/dispatch_bytes.py [--steps 3]
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlframe.config import build_config  # noqa: E402
from rlframe.controller.dispatch import select_reads  # noqa: E402
from rlframe.controller.worker_group import WorkerGroup  # noqa: E402


def pickled_bytes(args: tuple, kwargs: dict) -> int:
    return len(pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL))


def measure(steps: int) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Per method: bytes of whole arguments, bytes of the read keys, calls (all steps)."""
    whole: dict[str, int] = defaultdict(int)
    read: dict[str, int] = defaultdict(int)
    calls: dict[str, int] = defaultdict(int)
    submit = WorkerGroup.submit

    def measured_submit(self: WorkerGroup, method: str, *args: Any, **kwargs: Any) -> Any:
        reads = self.methods[method].reads if method in self.methods else None
        whole[method] += pickled_bytes(args, kwargs)
        read[method] += pickled_bytes(*select_reads(method, reads, args, kwargs))
        calls[method] += 1
        return submit(self, method, *args, **kwargs)

    from rlframe.run.launch import run_training

    # The measurement wraps the real submit; nothing else changes.
    WorkerGroup.submit = measured_submit  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as out:
        cfg = build_config(
            {
                "model": {"path": "tiny:0"},
                **recipe(),
                "trainer": recipe()["trainer"] | {"total_steps": steps, "output_dir": out},
            }
        )
        run_training(cfg, resume_from=None)
    WorkerGroup.submit = submit  # type: ignore[method-assign]
    return whole, read, calls


def recipe() -> dict[str, Any]:
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(OmegaConf.load(REPO / "recipes" / "grpo_tiny.yaml"))
    assert isinstance(tree, dict)
    tree["trainer"] = dict(tree["trainer"]) | {"loggers": ["jsonl"]}
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    steps = parser.parse_args().steps
    whole, read, calls = measure(steps)
    print(f"grpo_tiny, {steps} steps, bytes per step shipped to workers (pickled arguments):")
    print(f"{'method':<22}{'calls/step':>11}{'before':>14}{'after':>14}{'ratio':>8}")
    for method in sorted(whole):
        before, after = whole[method] / steps, read[method] / steps
        print(
            f"{method:<22}{calls[method] / steps:>11.1f}{before:>14,.0f}{after:>14,.0f}"
            f"{after / max(before, 1):>8.2f}"
        )
    before, after = sum(whole.values()) / steps, sum(read.values()) / steps
    print(f"{'total':<22}{'':>11}{before:>14,.0f}{after:>14,.0f}{after / before:>8.2f}")


if __name__ == "__main__":
    main()
