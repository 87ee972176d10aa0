"""Worker groups: one Ray actor per bundle of a pool, driven as one object from the driver.

``WorkerGroup(pool, cls, role=..., ...)`` starts ``pool.world_size`` actors of ``cls`` with
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in their
environment, and binds every ``@dispatch``-marked method of ``cls`` as a driver-side
function: ``group.generate(batch)`` splits, calls all ranks and collects as the method's
mode says.

Calls can also be started without waiting: ``handle = group.submit("update", batch)``
returns a :class:`CallHandle` at once and ``handle.result()`` later returns what
``group.update(batch)`` would have; a blocking call is exactly submit then result.
:func:`wait_calls` waits on handles of several groups together (a weight sync's sender and
receivers), so whichever side fails first ends the wait, named.

Waiting never hangs: each call has a deadline (``call_timeout_s`` from the moment it was
submitted), and the first rank that fails (raises or dies) ends the wait with a
:class:`WorkerError` naming the role, the rank and the method, even while other ranks are
still blocked in a collective with the dead one.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

import ray
from ray.actor import ActorClass
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from rlframe.config.checks import first_line
from rlframe.controller.dispatch import (
    Dispatch,
    FanOut,
    collect_results,
    find_dispatch_methods,
    select_reads,
    split_call,
)
from rlframe.controller.liveness import find_stopped_ranks
from rlframe.controller.placement import ResourcePool
from rlframe.controller.worker import RENDEZVOUS_FILE_ENV

WAIT_SLICE_S = 1.0
"""Longest single ``ray.wait`` of :func:`wait_calls`. Ctrl-C or SIGTERM during a wait runs
the driver's handler inside Ray, whose exception only surfaces when that ``ray.wait``
returns: one unbounded wait for worker start-up held an interrupted run 12 s."""


class WorkerError(RuntimeError):
    """A worker call failed: the worker raised, died or did not answer in time."""

    def __init__(
        self, role: str, rank: int | None, method: str, detail: str, died: bool = False
    ) -> None:
        self.role, self.rank, self.method, self.detail = role, rank, method, detail
        self.died = died
        """The rank's process died: it is the cause, whatever its peers were doing."""
        who = f"rank {rank}" if rank is not None else "ranks"
        super().__init__(f"{role} worker {who} failed in {method}(): {detail}")


class WorkerGroup:
    """The actors of one role, one per bundle of ``pool``, in rank order.

    Args:
        pool: a created :class:`ResourcePool`.
        worker_cls: the worker class (a subclass of ``rlframe.controller.worker.Worker``).
        role: name used in errors and actor names (``actor``, ``critic``...).
        init_args: positional arguments for ``worker_cls(...)`` on every rank.
        call_timeout_s: the longest wait for one call.
        start_timeout_s: the longest wait for the actors to start (imports, model loading).
        env: extra environment variables for every worker process.
        rollout_tp_size: ranks per rollout tensor-parallel group, for ``ROLLOUT_DP_SPLIT``.
        wait: wait for every actor's constructor before returning (else see ``started``).
    """

    def __init__(
        self,
        pool: ResourcePool,
        worker_cls: type,
        *,
        role: str,
        init_args: tuple[Any, ...] = (),
        call_timeout_s: float = 3600.0,
        start_timeout_s: float = 900.0,
        env: dict[str, str] | None = None,
        rollout_tp_size: int = 1,
        wait: bool = True,
    ) -> None:
        self.role = role
        self.world_size = pool.world_size
        self.rollout_tp_size = rollout_tp_size
        self.call_timeout_s = call_timeout_s
        self.methods = find_dispatch_methods(worker_cls)
        self.actors = self.start_actors(pool, worker_cls, init_args, env or {})
        for name in self.methods:
            setattr(self, name, partial(self.call, name))
        # Constructor errors surface here, named as such, not at the first real call.
        ready = {a.__ray_ready__.remote(): r for r, a in enumerate(self.actors)}
        self.started = CallHandle(self.role, "__init__", ready, start_timeout_s, self.actors)
        """The actors' construction; ``wait=False`` leaves it to the caller (several groups
        then start at once: :func:`wait_calls` on their ``started``)."""
        if wait:
            self.started.result()

    def start_actors(
        self, pool: ResourcePool, worker_cls: type, init_args: tuple[Any, ...], env: dict[str, str]
    ) -> list[Any]:
        master_addr, master_port = pool.find_master_address()
        group_id = uuid.uuid4().hex
        # One node: rendezvous through a file there, so nothing listens on the network.
        rendezvous = (
            {RENDEZVOUS_FILE_ENV: f"{tempfile.gettempdir()}/rlframe_rendezvous_{group_id}"}
            if pool.nnodes == 1
            else {}
        )
        remote_cls: ActorClass[Any] = ray.remote(worker_cls)
        actors = []
        for rank in range(self.world_size):
            rank_env = {
                **rendezvous,
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                # Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPU, so it is always device 0.
                "LOCAL_RANK": "0" if pool.device == "cuda" else str(rank % pool.procs_per_node),
                "LOCAL_WORLD_SIZE": str(pool.procs_per_node),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "RLFRAME_ROLE": self.role,
                **env,
            }
            actor = remote_cls.options(
                name=None,
                max_restarts=0,
                scheduling_strategy=pool.scheduling(rank),
                runtime_env={"env_vars": rank_env},
                **pool.actor_resources(),
            ).remote(*init_args)
            actors.append(actor)
        return actors

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` on the ranks its dispatch mode names and collect the results."""
        return self.submit(method, *args, **kwargs).result()

    def submit(self, method: str, *args: Any, **kwargs: Any) -> CallHandle:
        """Start ``method`` on the ranks without waiting; ``.result()`` collects it."""
        spec = self.methods.get(method)
        if spec is None:
            raise AttributeError(
                f"{self.role} workers have no @dispatch method {method!r}; "
                f"they have {sorted(self.methods)}"
            )
        args, kwargs = select_reads(method, spec.reads, args, kwargs)
        fan_out = split_call(spec.mode, self.world_size, args, kwargs, self.rollout_tp_size)
        if spec.mode is Dispatch.ONE_TO_ALL and self.world_size > 1:
            # Serialise shared arguments once rather than once per rank; Ray resolves
            # top-level ObjectRef arguments back to values in the worker.
            shared_args = tuple(ray.put(a) for a in args)
            shared_kwargs = {k: ray.put(v) for k, v in kwargs.items()}
            for c in fan_out.calls:
                c.args, c.kwargs = shared_args, shared_kwargs
        refs = {
            getattr(self.actors[c.rank], method).remote(*c.args, **c.kwargs): c.rank
            for c in fan_out.calls
        }
        return CallHandle(
            self.role, method, refs, self.call_timeout_s, self.actors, (spec.mode, fan_out)
        )

    def shutdown(self) -> None:
        """Kill every actor of the group (stuck collectives included)."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []

    def __getattr__(self, name: str) -> Callable[..., Any]:
        # Only reached for names that are not bound dispatch methods: say what exists.
        if name.startswith("__") or name in ("methods", "role", "actors"):
            raise AttributeError(name)
        raise AttributeError(
            f"{self.role} workers have no @dispatch method {name!r}; "
            f"they have {sorted(self.methods)}"
        )


class CallHandle:
    """One submitted worker-group call: its per-rank Ray refs and its deadline.

    ``result()`` waits (until the deadline set at submit) and returns what the blocking
    call returns, raising :class:`WorkerError` for the first rank that raised or died, or
    for the ranks still silent at the deadline. The outcome is kept: a second ``result()``
    returns (or raises) the same without waiting again.
    """

    def __init__(
        self,
        role: str,
        method: str,
        refs: dict[Any, int],
        timeout_s: float,
        actors: list[Any],
        dispatch: tuple[Dispatch, FanOut] | None = None,
    ) -> None:
        self.role, self.method, self.refs, self.timeout_s = role, method, refs, timeout_s
        self.actors = actors
        self.dispatch = dispatch
        """How the ranks' results combine (the method's mode and how its call was split);
        None: they come back as a list, rank by rank."""
        self.deadline = time.monotonic() + timeout_s
        self.values: dict[int, Any] = {}
        self.pending = set(refs)
        self.silent: set[Any] = set()
        """Refs of the ranks that had neither answered nor failed when the call failed."""
        self.outcome: tuple[bool, Any] | None = None
        """(True, result) or (False, the WorkerError) once settled."""

    def result(self) -> Any:
        """The call's collected result (see the class docstring)."""
        (value,) = wait_calls(self)
        return value

    def fetch(self, ref: Any) -> None:
        """Take one finished rank's value; raises WorkerError if it failed."""
        self.pending.discard(ref)
        rank = self.refs[ref]
        try:
            self.values[rank] = ray.get(ref, timeout=self.timeout_s)
        except RayTaskError as e:
            self.fail(WorkerError(self.role, rank, self.method, describe_task_error(e)))
        except RayActorError as e:
            # The full text carries the creation task's traceback when a constructor raised.
            detail = f"the worker process died: {str(e).strip()}"
            self.fail(WorkerError(self.role, rank, self.method, detail, died=True))
        except GetTimeoutError:
            detail = "result could not be fetched in time"
            self.fail(WorkerError(self.role, rank, self.method, detail))

    def expire(self) -> None:
        ranks = sorted(self.refs[r] for r in self.pending)
        self.fail(
            WorkerError(
                self.role,
                None,
                self.method,
                f"ranks {ranks} did not answer within {self.timeout_s:.0f} s; a rank may be "
                "stuck in a collective with a dead peer (ray.call_timeout_s sets the limit)",
            )
        )

    def fail(self, error: WorkerError) -> None:
        self.silent = set(self.pending)
        self.outcome, self.pending = (False, error), set()
        raise error

    def silent_ranks(self) -> dict[int, Any]:
        """rank -> actor of the ranks that have neither answered nor failed."""
        refs = self.pending if self.outcome is None else self.silent
        return {self.refs[ref]: self.actors[self.refs[ref]] for ref in refs}

    def settle(self) -> Any:
        """The collected result once every rank answered (call with nothing pending)."""
        if self.outcome is None:
            ranked = [self.values[rank] for rank in sorted(self.values)]
            value = ranked if self.dispatch is None else collect_results(*self.dispatch, ranked)
            self.outcome = (True, value)
        ok, value = self.outcome
        if not ok:
            raise value
        return value


def wait_calls(*handles: CallHandle) -> list[Any]:
    """Wait on calls of one or several groups together; their results, in argument order.

    The first failure among all of them (a rank that raised or died, or a call past its
    own deadline) raises its :class:`WorkerError` at once, whatever the other calls are
    doing: when one side of a weight sync dies, the other side is typically blocked in a
    collective with it and would never answer.
    """
    owner = {ref: h for h in handles if h.outcome is None for ref in h.pending}
    try:
        while owner:
            now = time.monotonic()
            for handle in {id(h): h for h in owner.values()}.values():
                if handle.deadline <= now:
                    handle.expire()
            timeout = min(min(h.deadline for h in owner.values()) - now, WAIT_SLICE_S)
            ready, _ = ray.wait(list(owner), num_returns=1, timeout=max(timeout, 0))
            for ref in ready:
                owner.pop(ref).fetch(ref)
    except WorkerError as error:
        stopped = find_stopped_peer(error, handles)
        if stopped is None:
            raise
        raise stopped from None
    return [h.settle() for h in handles]


def find_stopped_peer(error: WorkerError, handles: tuple[CallHandle, ...]) -> WorkerError | None:
    """The error to raise instead of ``error`` when a rank still silent in one of the calls
    waited on together (the failed one included) is a stopped process (see
    :mod:`rlframe.controller.liveness`): the failure of a rank that waited for it, or of the
    whole call at its deadline, is then a symptom. None when there is none."""
    if error.died:
        return None
    for handle in handles:
        silent = handle.silent_ranks()
        stopped = find_stopped_ranks(silent) if silent else {}
        if stopped:
            rank, pid = min(stopped.items())
            waited = f"{error.role} {error.method}() failed waiting for it: {first_line(error)}"
            detail = (
                f"the worker process (pid {pid}) is stopped (SIGSTOP, or held by a debugger) "
                f"and did not answer; {waited}"
            )
            return WorkerError(handle.role, rank, handle.method, detail)
    return None


def describe_task_error(error: RayTaskError) -> str:
    """The worker's exception type and message, then its remote traceback."""
    cause = getattr(error, "cause", None)
    headline = (
        f"{type(cause).__name__}: {cause}"
        if isinstance(cause, BaseException)
        else first_line(error)
    )
    return f"{headline}\n--- remote traceback ---\n{str(error).rstrip()}"
