"""A colocated worker that counts its rollout engine's sleep, wake and generate calls per
step, for the test that a generation phase keeps the engine awake.

Each weight sync closes a step's window: rank 0 appends ``{"sleep": .., "wake_up": ..,
"generate": ..}`` (calls since the previous sync) to ``engine_calls.jsonl`` in the run
directory. Load it with ``actor.worker_cls=tests.plugins.engine_calls.CountingHybridWorker``
and ship this module by value to the Ray workers, which cannot import the tests package.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from rlframe.config import Config
from rlframe.controller.dispatch import Dispatch, dispatch
from workers.hybrid import HybridWorker
from workers.inference.base import RolloutEngine

COUNTED = ("sleep", "wake_up", "generate")
LOG_NAME = "engine_calls.jsonl"


class CountingEngine:
    """The real engine, with its sleep, wake and generate calls counted."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.engine, name)
        if name not in COUNTED:
            return method

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return method(*args, **kwargs)

        return counted


class CountingHybridWorker(HybridWorker):
    """The colocated worker, its engine's calls written down at every sync."""

    def __init__(self, cfg: Config, model_path: str, device: str) -> None:
        super().__init__(cfg, model_path, device)
        self.counting = CountingEngine(self.rollout_role.engine)
        self.rollout_role.engine = self.counting  # type: ignore[assignment]
        self.log = Path(cfg.trainer.output_dir) / LOG_NAME

    @dispatch(Dispatch.ONE_TO_ALL)
    def sync_weights(self) -> int:
        version = super().sync_weights()
        if self.rank == 0:
            with self.log.open("a") as f:
                f.write(json.dumps({k: self.counting.calls[k] for k in COUNTED}) + "\n")
        self.counting.calls.clear()
        return version
