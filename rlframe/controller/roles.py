"""What the driver may call on each role's worker group, with types.

A :class:`~rlframe.controller.worker_group.WorkerGroup` binds its worker class's
``@dispatch`` methods at run time, so on its own it is untyped. These Protocols write the
driver-side signature of each role's methods (a DP_SPLIT method takes and returns a Batch,
or returns one value per rank; a ONE_TO_ALL method returns one value per rank; a training
method's worker side receives the Batch as the typed
:class:`~rlframe.core.train_batch.TrainBatch` its ``@dispatch(reads=...)`` declares) and
:func:`bind_role` checks, when a group starts, that its worker class has every one of them,
then hands the group back typed as that role. Users' own worker classes are checked the
same way: a missing method fails at start, named, not at the first call of a run.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from rlframe.core.protocol import Batch, UpdateResult

if TYPE_CHECKING:
    from rlframe.controller.weight_group import WeightGroupSpec
    from rlframe.controller.worker_group import CallHandle, WorkerGroup


class Group(Protocol):
    """Every worker group: its role name, non-blocking calls and shutdown."""

    role: str
    world_size: int
    actors: list[Any]
    """The group's Ray actors, in rank order."""

    def submit(self, method: str, *args: Any, **kwargs: Any) -> CallHandle: ...

    def shutdown(self) -> None: ...


class ActorGroup(Group, Protocol):
    """The policy's training side: log-probs, reference log-probs, updates, checkpoints."""

    def compute_logprobs(self, batch: Batch) -> Batch: ...

    def compute_ref_logprobs(self, batch: Batch) -> Batch: ...

    def update(self, batch: Batch) -> list[UpdateResult]: ...

    def save_checkpoint(self, path: str) -> list[None]: ...

    def load_checkpoint(self, path: str) -> list[int]: ...


class HybridGroup(ActorGroup, Protocol):
    """Colocated placement: each rank also holds the rollout engine."""

    def generate(self, prompts: Batch) -> Batch: ...

    def open_stream(self) -> list[None]: ...

    def sync_weights(self) -> list[int]: ...

    def read_sync_check(self) -> list[dict[str, Any] | None]: ...


class TrainGroup(ActorGroup, Protocol):
    """Separate placement, training side: sends its weights to the rollout pool."""

    def init_weight_group(self, spec: WeightGroupSpec) -> list[None]: ...

    def send_weights(self, bump_version: bool = True) -> list[int]: ...


class RolloutGroup(Group, Protocol):
    """Separate placement, rollout side: generates and receives weights."""

    def generate(self, prompts: Batch) -> Batch: ...

    def open_stream(self) -> list[None]: ...

    def init_weight_group(self, spec: WeightGroupSpec) -> list[None]: ...

    def receive_weights(self) -> list[int]: ...

    def read_sync_check(self) -> list[dict[str, Any] | None]: ...


class CriticGroup(Group, Protocol):
    def compute_values(self, batch: Batch) -> Batch: ...

    def update(self, batch: Batch) -> list[dict[str, float]]: ...

    def save_checkpoint(self, path: str) -> list[None]: ...

    def load_checkpoint(self, path: str) -> list[None]: ...


class RewardModelGroup(Group, Protocol):
    def compute_rm_scores(self, batch: Batch) -> Batch: ...


R = TypeVar("R", bound=Group)


def find_role_methods(role: type[Group]) -> dict[str, inspect.Signature]:
    """The worker methods a role Protocol names (not those every group has), with their
    driver-side signatures."""
    common = set(vars(Group))
    found = {}
    for cls in reversed(role.__mro__):
        if cls is Group or not getattr(cls, "_is_protocol", False):
            continue
        for name, value in vars(cls).items():
            if inspect.isfunction(value) and name not in common and not name.startswith("_"):
                found[name] = inspect.signature(value)
    return found


def check_role(role: type[Group], worker_cls: type, dispatch_methods: dict[str, Any]) -> None:
    """Raise TypeError unless ``worker_cls`` has every method of ``role`` as a ``@dispatch``
    method taking the same parameters."""
    wanted = find_role_methods(role)
    missing = sorted(set(wanted) - set(dispatch_methods))
    if missing:
        raise TypeError(
            f"{worker_cls.__module__}.{worker_cls.__qualname__} cannot serve as a "
            f"{role.__name__}: it has no @dispatch method {', '.join(missing)}"
        )
    for name, signature in wanted.items():
        theirs = inspect.signature(getattr(worker_cls, name))
        # ray.remote(cls) adds a tracing keyword to the class's methods.
        params = [p for p in theirs.parameters if not p.startswith("_ray_")]
        if params != list(signature.parameters):
            raise TypeError(
                f"{worker_cls.__qualname__}.{name}{theirs} does not match "
                f"{role.__name__}.{name}{signature}"
            )


def bind_role(group: WorkerGroup, role: Callable[..., R], worker_cls: type) -> R:
    """``group`` typed as ``role`` (a role Protocol class) after :func:`check_role` on the
    class it runs."""
    # ``role`` is spelled Callable, not type[R]: mypy refuses a Protocol class where type[R]
    # is expected (its type-abstract check, python/mypy#4717), so the class is checked here.
    if not isinstance(role, type):
        raise TypeError(f"bind_role needs a role class, got {role!r}")
    check_role(role, worker_cls, group.methods)
    return cast(R, group)
