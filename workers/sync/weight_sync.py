"""Weight transports: a source yields the training role's weights as named buckets, a sink
loads them into a rollout engine.

- :class:`WeightSource`: every ``state_dict`` entry of the policy, gathered to a full tensor
  bucket by bucket (a collective on every training rank), named as the engine expects.
- :class:`InProcessSink`: the engine lives in the same process (colocated placement).
- :class:`BroadcastSender` / :class:`BroadcastReceiver`: the engine lives in another process
  (a separate rollout pool). Trainer rank 0 broadcasts each bucket over a
  :class:`WeightGroup`, a torch.distributed group of its own that spans both pools.

Every push carries a weights version, which the rollout role records and stamps on every row
it generates afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from rlframe.controller.weight_group import WeightGroupSpec
from rlframe.models.hf_config import is_vision_tower_name
from workers.model_hooks.weight_names import CheckpointLayout
from workers.sync.sync_probe import ProbeVerdict, SyncProbe
from workers.training.dtensor_gather import full_tensor
from workers.training.expert_parallel import find_expert_parallel

WeightBucket = list[tuple[str, torch.Tensor]]


class RolloutReceiver(Protocol):
    """What a sink loads into: a rollout role (:class:`workers.roles.rollout_role.RolloutRole`)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace the engine's weights in place and record their version."""

    def check_sync(self, probe: SyncProbe) -> ProbeVerdict:
        """The receiver check after a sync: its verdict, kept for the driver to read."""


class WeightSource:
    """The policy's weights as ``(engine name, full tensor)`` buckets.

    ``state_dict`` (not ``named_parameters``) so that tied weights such as ``lm_head`` appear
    under their own name (vLLM otherwise keeps a stale head). A bucket holds at least
    ``bucket_bytes`` (the last one may hold less) and is gathered only when asked for, so at
    most one bucket of full tensors is alive beyond the one being consumed. Gathering is a
    collective: every training rank must consume the whole stream, in the same order.
    """

    def __init__(
        self,
        model: nn.Module,
        bucket_bytes: int,
        dtype: torch.dtype | None = None,
        tensors: Callable[[nn.Module], Iterator[tuple[str, torch.Tensor]]] | None = None,
    ):
        self.model, self.bucket_bytes, self.dtype = model, bucket_bytes, dtype
        self.tensors = tensors or iter_full_tensors
        """What travels: every full tensor (default), LoRA-merged ones, or adapters only."""

    def iter_buckets(self) -> Iterator[WeightBucket]:
        bucket: WeightBucket = []
        size = 0
        for name, tensor in self.tensors(self.model):
            if self.dtype is not None:
                tensor = tensor.to(self.dtype)
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.iter_buckets():
            yield from bucket


def iter_full_tensors(
    model: nn.Module, with_vision: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every ``state_dict`` entry as ``(engine name, full tensor)`` in the checkpoint's
    layout (:class:`CheckpointLayout`: fused experts split as the family's checkpoint holds
    them; expert-parallel experts gathered from their ranks first). ``with_vision=False``
    skips the vision tower before any gather (``model.freeze_vision``: the engine keeps the
    copy it loaded, which never changes)."""
    layout = CheckpointLayout(model)
    experts = find_expert_parallel(model)
    for name, value in model.state_dict().items():
        if with_vision or not is_vision_tower_name(name):
            if experts is not None and experts.holds(value):
                whole = experts.gather(value.detach())
            else:
                whole = full_tensor(value).detach()
            yield from layout.to_engine_tensors(name, whole)


class InProcessSink:
    """Loads a source straight into a rollout role of the same process."""

    def __init__(self, rollout: RolloutReceiver) -> None:
        self.rollout = rollout

    def push(self, source: WeightSource, version: int) -> None:
        self.rollout.load_weights(source.iter_tensors(), version)


class WeightGroup:
    """A torch.distributed process group of its own over the trainer pool and the rollout
    pool: ranks ``0..trainer_world-1`` are the trainer's, the rollout ranks follow.

    Each process already has a default group (its own pool's FSDP or vLLM world), and
    ``new_group`` can only take ranks of that world, so this group is built standalone from
    a TCP store at the spec's address (the store's server runs in trainer rank 0) and used
    through the process-group object's own collectives. gloo on CPU, NCCL on GPU.
    """

    def __init__(
        self, spec: WeightGroupSpec, rank: int, device: str, timeout_s: float = 1800.0
    ) -> None:
        self.rank, self.device = rank, device
        self.world_size = spec.trainer_world + spec.rollout_world
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(
            spec.master_addr,
            spec.master_port,
            self.world_size,
            is_master=rank == 0,
            timeout=timeout,
        )
        prefixed = dist.PrefixStore("rlframe-weights", store)
        self.store = store  # the server lives as long as the group (trainer rank 0)
        self.group = build_backend_group(device, prefixed, rank, self.world_size, timeout)

    @property
    def timeout(self) -> timedelta:
        """How long a collective of this group may wait for its peers before it fails."""
        # torch's stubs lack ProcessGroup.options, which NCCL and gloo groups have.
        timeout: timedelta = self.group.options._timeout  # type: ignore[attr-defined]
        return timeout

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's ``tensor`` into every other rank's ``tensor`` (same shape and dtype);
        returns once the broadcast is done on this host, so a caller may free or reuse the
        tensor and the sender holds one bucket at a time."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()
        if tensor.is_cuda:
            # NCCL's wait only orders the current stream after the broadcast; the host runs
            # on. Without this the sender queues every bucket of the model at once.
            torch.cuda.current_stream(tensor.device).synchronize()


def build_backend_group(
    device: str, store: dist.Store, rank: int, size: int, timeout: timedelta
) -> dist.ProcessGroup:
    """A standalone NCCL (cuda) or gloo (cpu) group whose collectives fail after ``timeout``.

    NCCL keeps its own 10-minute default otherwise: a rollout call longer than that while
    the trainer waits in a sync (asynchronous separate mode) would abort both processes.
    """
    if device == "cuda":
        backend: type = dist.ProcessGroupNCCL
        options = dist.ProcessGroupNCCL.Options()
    else:
        backend = dist.ProcessGroupGloo
        # torch's stubs lack gloo's _Options, the only way to give a gloo group its timeout.
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
    options._timeout = timeout
    # The NCCL/gloo backend object has a ProcessGroup's collectives (broadcast), which
    # torch's stubs give ProcessGroup and leave off Backend.
    return cast(dist.ProcessGroup, backend(store, rank, size, options))


@dataclass(frozen=True)
class BucketHeader:
    """What a receiver needs to cut one broadcast bucket back into named tensors."""

    version: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    probe: list[Any] | None = None
    """On the end marker, when the sync is verified: ``[ids, trainer log-probs]`` of the probe
    (JSON floats hold fp32 values exactly)."""

    @property
    def is_end(self) -> bool:
        """An empty header closes a push."""
        return not self.names

    def encode(self) -> torch.Tensor:
        text = json.dumps([self.version, self.names, self.dtypes, self.shapes, self.probe])
        return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)

    @staticmethod
    def decode(data: torch.Tensor) -> BucketHeader:
        return BucketHeader(*json.loads(bytes(data.cpu().numpy()).decode()))

    def read_probe(self) -> SyncProbe | None:
        if self.probe is None:
            return None
        return SyncProbe(self.probe[0], torch.tensor(self.probe[1], dtype=torch.float32))

    def tensor_bytes(self) -> list[int]:
        return [
            torch.Size(shape).numel() * getattr(torch, dtype).itemsize
            for dtype, shape in zip(self.dtypes, self.shapes, strict=True)
        ]


def pack_bucket(bucket: WeightBucket, device: str) -> torch.Tensor:
    """One contiguous byte buffer of the bucket's tensors, in order."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]).to(device)


class BroadcastSender:
    """The training side of a cross-process push: every trainer rank walks the source (the
    gathers are collectives of the trainer's own group) and joins each broadcast; rank 0's
    buffers are the ones sent, the other trainer ranks' buffers are overwritten with the same
    bytes. Per bucket: the header's length, the header (JSON), then the packed tensors."""

    def __init__(self, group: WeightGroup) -> None:
        self.group = group

    def push(self, source: WeightSource, version: int, probe: SyncProbe | None = None) -> int:
        """Broadcast every bucket, then an end marker (carrying ``probe`` for the receiver
        check, when given); returns the payload bytes sent."""
        sent = 0
        for bucket in source.iter_buckets():
            header = BucketHeader(
                version,
                [name for name, _ in bucket],
                [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                [list(t.shape) for _, t in bucket],
            )
            self.send_header(header)
            payload = pack_bucket(bucket, self.group.device)
            self.group.broadcast(payload)
            sent += payload.numel()
        end = None if probe is None else [probe.ids, probe.logprobs.tolist()]
        self.send_header(BucketHeader(version, [], [], [], end))
        return sent

    def send_header(self, header: BucketHeader) -> None:
        data = header.encode().to(self.group.device)
        self.group.broadcast(torch.tensor([data.numel()], device=self.group.device))
        self.group.broadcast(data)


class BroadcastReceiver:
    """The rollout side of a cross-process push: receives the buckets and loads them into the
    rollout role as they arrive (one bucket alive at a time), with the pushed version."""

    def __init__(self, group: WeightGroup) -> None:
        self.group = group

    def pull(self, rollout: RolloutReceiver) -> int:
        """Load one whole push into ``rollout``, then run the receiver check when the push
        carried a probe (its verdict stays in the rollout role for the driver to read: a
        failed check stops the run there, with the step logged); returns the version it
        carried."""
        first = self.receive_header()
        self.end: BucketHeader | None = first if first.is_end else None
        rollout.load_weights(self.iter_tensors(first), first.version)
        probe = self.end.read_probe() if self.end is not None else None
        if probe is not None:
            rollout.check_sync(probe)
        return first.version

    def receive_header(self) -> BucketHeader:
        length = torch.zeros(1, dtype=torch.long, device=self.group.device)
        self.group.broadcast(length)
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=self.group.device)
        self.group.broadcast(data)
        return BucketHeader.decode(data)

    def iter_tensors(self, header: BucketHeader) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of ``header``'s bucket and of every bucket after it, up to the end
        marker; a bucket of another version means two pushes got interleaved."""
        version = header.version
        while not header.is_end:
            sizes = header.tensor_bytes()
            payload = torch.empty(sum(sizes), dtype=torch.uint8, device=self.group.device)
            self.group.broadcast(payload)
            parts = payload.split(sizes)
            for name, dtype, shape, part in zip(
                header.names, header.dtypes, header.shapes, parts, strict=True
            ):
                kind = getattr(torch, dtype)
                if part.storage_offset() % kind.itemsize:  # a view needs aligned storage
                    part = part.clone()
                yield name, part.view(kind).reshape(shape)
            header = self.receive_header()
            self.end = header if header.is_end else None
            if header.version != version:
                raise RuntimeError(
                    f"weight push of version {version} interrupted by a bucket of version "
                    f"{header.version}"
                )
