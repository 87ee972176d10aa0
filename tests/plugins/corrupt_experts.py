"""Worker classes whose weight sync corrupts one routed expert of a mixture-of-experts model,
for the sync-check tests: every other tensor arrives intact and the sync reports success.

- ``swap``: layer 0's experts 0 and 1 arrive in each other's place (every shape right);
- ``drop``: layer 0's expert 0 never arrives (the loader gets the rest).

Set the corruption with ``corrupt_experts(kind)`` (``None`` syncs honestly again). Ship this
module by value to the Ray workers, which cannot import the tests package.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from rlframe.config import Config
from rlframe.controller.dispatch import Dispatch, dispatch
from workers.hybrid import HybridWorker
from workers.roles.rollout_role import RolloutRole
from workers.rollout_worker import RolloutWorker
from workers.sync.sync_probe import ProbeVerdict, SyncProbe
from workers.sync.weight_sync import InProcessSink

EXPERT = re.compile(r"^model\.layers\.0\.mlp\.experts\.([01])\.")
SWAPPED = {"0": "1", "1": "0"}


def corrupt_stream(
    weights: Iterable[tuple[str, torch.Tensor]], kind: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` (engine names, per expert) with layer 0's experts 0 and 1 swapped, or its
    expert 0 dropped."""
    for name, tensor in weights:
        found = EXPERT.match(name)
        if found is None:
            yield name, tensor
        elif kind == "swap":
            yield name.replace(f"experts.{found[1]}.", f"experts.{SWAPPED[found[1]]}.", 1), tensor
        elif kind == "drop" and found[1] == "1":
            yield name, tensor
        elif kind != "drop":
            raise ValueError(f"unknown corruption {kind!r}")


class CorruptingRollout:
    """Stands in for a rollout role at a weight push, corrupting what it loads."""

    def __init__(self, role: RolloutRole) -> None:
        self.role = role
        self.kind: str | None = None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.role.load_weights(
            weights if self.kind is None else corrupt_stream(weights, self.kind), version
        )

    def check_sync(self, probe: SyncProbe) -> ProbeVerdict:
        return self.role.check_sync(probe)


class CorruptExpertsHybridWorker(HybridWorker):
    """The colocated worker, its engine loading corrupted experts when told to."""

    def __init__(self, cfg: Config, model_path: str, device: str) -> None:
        super().__init__(cfg, model_path, device)
        self.corrupting = CorruptingRollout(self.rollout_role)
        self.sink = InProcessSink(self.corrupting)  # type: ignore[arg-type]

    @dispatch(Dispatch.ONE_TO_ALL)
    def corrupt_experts(self, kind: str | None) -> None:
        self.corrupting.kind = kind


class CorruptExpertsRolloutWorker(RolloutWorker):
    """The separate pool's rollout worker, loading corrupted experts when told to."""

    def __init__(self, cfg: Config, model_path: str, device: str) -> None:
        super().__init__(cfg, model_path, device)
        self.corrupting = CorruptingRollout(self.rollout_role)

    @dispatch(Dispatch.ONE_TO_ALL)
    def corrupt_experts(self, kind: str | None) -> None:
        self.corrupting.kind = kind

    @dispatch(Dispatch.ONE_TO_ALL)
    def receive_weights(self) -> int:
        if self.receiver is None:
            raise RuntimeError("receive_weights before init_weight_group")
        return self.receiver.pull(self.corrupting)  # type: ignore[arg-type]
