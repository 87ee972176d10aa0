"""Small worker classes that the Ray tests drive through real worker groups, and the rows
they read. Ray workers cannot import the tests package: tests/ray/conftest.py ships this
module to them by value."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from rlframe.controller.dispatch import Dispatch, dispatch
from rlframe.controller.worker import Worker
from rlframe.core.protocol import Batch


def rows(n: int) -> Batch:
    """``n`` rows of ``x`` = 0..n-1 tagged ``row<i>``: what the echo workers scale and count."""
    return Batch(
        {"x": torch.arange(n, dtype=torch.float32)}, {"tag": [f"row{i}" for i in range(n)]}
    )


class EchoWorker(Worker):
    """Scales its batch chunk and reports who it is; joins a gloo group on demand."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.calls: dict[str, int] = {}

    def count_call(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1

    @dispatch(Dispatch.ONE_TO_ALL)
    def describe(self) -> dict[str, object]:
        """Where this rank runs: its rank and the rendezvous address it was given."""
        master = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        return {"rank": self.rank, "pid": os.getpid(), "master": master}

    @dispatch(Dispatch.ONE_TO_ALL)
    def call_counts(self) -> dict[str, int]:
        """How often each counted method ran on this rank."""
        return dict(self.calls)

    @dispatch(Dispatch.DP_SPLIT)
    def scale_rows(self, batch: Batch, offset: float = 0.0) -> Batch:
        out = batch.tensors["x"] * self.scale + offset
        ranks = torch.full((len(batch),), self.rank, dtype=torch.long)
        return Batch({"y": out, "rank": ranks}, {"tag": batch.columns["tag"]})

    @dispatch(Dispatch.DP_SPLIT)
    def count_rows(self, batch: Batch) -> int:
        return len(batch)

    @dispatch(Dispatch.DP_SPLIT, reads=("x", "maybe"))
    def keys_seen(self, batch: Batch) -> Batch:
        """Declares what it reads: ``x`` and, when present, ``maybe``; reports what arrived."""
        return Batch({"y": batch.tensors["x"]}, {"seen": [sorted(batch.keys())] * len(batch)})

    @dispatch(Dispatch.ONE_TO_ALL)
    def env(self) -> dict[str, str]:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RLFRAME_ROLE")
        return {k: os.environ.get(k, "") for k in keys}

    @dispatch(Dispatch.ONE_TO_ALL)
    def all_reduce_ranks(self) -> float:
        """Sum of all ranks over a real gloo process group."""
        self.init_process_group("cpu", timeout_s=60)
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t)
        return t.item()

    @dispatch(Dispatch.RANK_ZERO)
    def whoami(self) -> int:
        self.count_call("whoami")
        return self.rank

    @dispatch(Dispatch.RANK_ZERO)
    def fail_rank_zero(self) -> int:
        raise ValueError(f"rank-zero method failed on rank {self.rank}")

    @dispatch(Dispatch.DP_SPLIT)
    def fail_rows_on(self, batch: Batch, rank: int) -> Batch:
        if self.rank == rank:
            raise ValueError(f"bad rows on rank {rank}")
        return Batch({"y": batch.tensors["x"]})

    @dispatch(Dispatch.DP_SPLIT)
    def drop_row_on(self, batch: Batch, rank: int) -> Batch:
        """Returns one row too few on ``rank``: a broken DP_SPLIT method."""
        x = batch.tensors["x"]
        return Batch({"y": x[:-1] if self.rank == rank else x})

    @dispatch(Dispatch.DP_SPLIT)
    def add_rows(self, a: Batch, b: Batch) -> Batch:
        self.count_call("add_rows")
        return Batch({"y": a.tensors["x"] + b.tensors["x"]})

    @dispatch(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"bad input on rank {rank}")
        return self.rank

    @dispatch(Dispatch.ONE_TO_ALL)
    def die_on(self, rank: int) -> int:
        """Rank ``rank`` dies mid-call; the others block as if in a collective with it."""
        if self.rank == rank:
            time.sleep(0.5)
            os._exit(1)
        time.sleep(600)
        return self.rank

    @dispatch(Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


class BrokenWorker(Worker):
    def __init__(self) -> None:
        super().__init__()
        raise RuntimeError("cannot load the model")

    @dispatch(Dispatch.ONE_TO_ALL)
    def ping(self) -> int:
        return self.rank
