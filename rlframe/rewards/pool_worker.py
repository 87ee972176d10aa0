"""One process of the reward pool: ``python -m rlframe.rewards.pool_worker SPEC``.

It loads the reward function ``SPEC`` (a registered name or ``pkg.module:fn`` /
``file.py:fn``), says ``ready``, then answers ``(task id, response, ground truth, sample)``
frames on stdin with ``(task id, score or None, error or None)`` frames. Anything the reward
prints goes to stderr: stdout carries only frames.
"""

from __future__ import annotations

import os
import sys

from rlframe.rewards.frames import read_frame, write_frame


def die_with_parent() -> None:
    """Linux: get SIGKILL when the driver dies, so a hung reward never outlives the run."""
    try:
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def main(spec: str) -> None:
    die_with_parent()
    out = os.dup(1)
    os.dup2(2, 1)  # print() in a reward function must not corrupt the frame stream
    from rlframe.rewards import REWARDS
    from rlframe.rewards.outcome import call_reward

    try:
        fn = REWARDS.get(spec)
    except Exception as e:
        write_frame(out, ("load_error", f"{type(e).__name__}: {e}"))
        return
    write_frame(out, ("ready", os.getpid()))
    while True:
        alive, task = read_frame(0)
        if not alive:
            return
        task_id, response, ground_truth, sample = task
        outcome = call_reward(fn, response, ground_truth, sample)
        write_frame(out, (task_id, outcome.score, outcome.error))


if __name__ == "__main__":
    main(sys.argv[1])
