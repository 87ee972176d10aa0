"""Which device the workers will train on, answered before Ray starts.

One answer for every check that depends on it (LoRA adapter sync of experts, routing replay
on vLLM, the pools' GPU fit): ``trainer.device`` when it names a device; with ``auto``, a
cluster joined (``ray.address`` or ``RAY_ADDRESS``) is assumed to have GPUs, and a Ray started
here trains on GPUs when this process can see any.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from rlframe.config.sections import Device, RayConfig

if TYPE_CHECKING:
    from rlframe.config.schema import Config


def will_start_local_ray(cfg: RayConfig) -> bool:
    """The run starts its own one-machine Ray (no cluster address given)."""
    return not (cfg.address or os.environ.get("RAY_ADDRESS"))


def count_local_gpus() -> int:
    """GPUs a Ray started here will advertise: those CUDA_VISIBLE_DEVICES leaves visible.
    torch counts them through NVML without creating a CUDA context."""
    import torch  # lazy: the schema imports nothing heavy

    return torch.cuda.device_count()


def will_train_on_cuda(cfg: Config, local_gpus: int | None = None) -> bool:
    """Whether the workers will train (and roll out) on CUDA. ``local_gpus`` is this
    machine's GPU count where the caller has it (counted here otherwise, and only when it
    matters)."""
    device = cfg.trainer.device
    if device is not Device.auto:
        return device is Device.cuda
    if not will_start_local_ray(cfg.ray):
        return True  # a joined cluster is asked after Ray; assume GPUs until then
    return (count_local_gpus() if local_gpus is None else local_gpus) > 0
