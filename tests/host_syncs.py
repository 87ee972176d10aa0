"""Counting, on a CPU, the operations that make a GPU's host wait for the device.

A CUDA host waits for the device (``torch.cuda.set_sync_debug_mode`` reports it) when Python
reads a value (``.item()``, ``int()``, ``bool()`` of a tensor: ``_local_scalar_dense``), when an
output's shape depends on values (``nonzero``, ``masked_select``, indexing by a boolean mask)
and when a pageable host tensor is copied to the device. None of these needs a GPU to be seen:
a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees each as the operator it
dispatches, but ``.tolist()``, which reads the memory without dispatching, only a
:class:`~torch.overrides.TorchFunctionMode` sees. Host-to-device copies look like any other
``_to_copy`` on a CPU, so the counter takes the ones it is told to (``copies_of``: the dtype
of the host tensors whose copies count).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
VALUE_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default}
"""Operators whose result the host needs before it can go on."""


def reads_values(func: Any, args: tuple[Any, ...]) -> bool:
    """Whether ``func(*args)`` needs the device's values on the host: a value read, or an
    index by a boolean mask (its output's shape is the mask's count)."""
    if func in VALUE_READS:
        return True
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        masks = args[1] if len(args) > 1 else ()
        return any(
            isinstance(m, torch.Tensor) and m.dtype in (torch.bool, torch.uint8) for m in masks
        )
    return False


class ListReads(TorchFunctionMode):
    """Counts ``Tensor.tolist`` calls into its owner's counts."""

    def __init__(self, counts: Counter[str]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.Tensor.tolist:
            self.counts["tolist"] += 1
        return func(*args, **(kwargs or {}))


class HostSyncCounter(TorchDispatchMode):
    """Counts, by operator name, the host waits of the operations run while it is active."""

    def __init__(self, copies_of: torch.dtype | None = None) -> None:
        super().__init__()
        self.copies_of = copies_of
        self.counts: Counter[str] = Counter()
        self.lists = ListReads(self.counts)

    def __enter__(self) -> HostSyncCounter:
        self.lists.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.lists.__exit__(*exc)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if reads_values(func, args):
            self.counts[str(func.overloadpacket.__name__)] += 1
        elif (
            func is aten._to_copy.default
            and self.copies_of is not None
            and args[0].dtype == self.copies_of
        ):
            self.counts["host_copy"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@contextmanager
def counting_in_hooks(
    modules: list[nn.Module], copies_of: torch.dtype | None = None
) -> Iterator[HostSyncCounter]:
    """Count the host waits of the forward hooks already registered on ``modules`` (not the
    modules' own forwards): a hook put in front of theirs starts the count, one put after
    them stops it."""
    counter = HostSyncCounter(copies_of)

    def start(*_: Any) -> None:
        counter.__enter__()

    def stop(*_: Any) -> None:
        counter.__exit__(None, None, None)

    handles = [m.register_forward_hook(start, prepend=True) for m in modules]
    handles += [m.register_forward_hook(stop) for m in modules]
    try:
        yield counter
    finally:
        for handle in handles:
            handle.remove()
