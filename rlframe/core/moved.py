"""Modules that moved when the tree was laid out by concern (rlframe 0.2), and an import hook
that names the new place.

A user's config names worker classes and plug-ins by dotted path, and a user's plug-in file
imports rlframe's types; an old path fails with one line naming the new one instead of a bare
``No module named``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

MOVED: dict[str, str] = {
    "rlframe.algorithms.names": "rlframe.core.names",
    "rlframe.algorithms.registry": "rlframe.core.registry",
    "rlframe.checkpoint": "rlframe.state.checkpoint",
    "rlframe.checkpoint_layout": "rlframe.state.checkpoint_layout",
    "rlframe.data.images": "rlframe.models.images",
    "rlframe.expert_parallel": "rlframe.models.expert_parallel",
    "rlframe.export": "rlframe.state.export",
    "rlframe.interrupts": "rlframe.run.interrupts",
    "rlframe.launch": "rlframe.run.launch",
    "rlframe.logs": "rlframe.observability.logs",
    "rlframe.lora_targets": "rlframe.models.lora_targets",
    "rlframe.model_checks": "rlframe.models.checks",
    "rlframe.model_config": "rlframe.models.hf_config",
    "rlframe.model_weights": "rlframe.models.weights",
    "rlframe.moe_routing": "rlframe.models.moe_routing",
    "rlframe.mrope": "rlframe.core.mrope",
    "rlframe.pools": "rlframe.run.pools",
    "rlframe.preflight": "rlframe.run.preflight",
    "rlframe.protocol": "rlframe.core.protocol",
    "rlframe.run_dir": "rlframe.state.run_dir",
    "rlframe.save_failures": "rlframe.state.save_failures",
    "rlframe.sequence_layout": "rlframe.core.sequence_layout",
    "rlframe.startup": "rlframe.observability.startup",
    "rlframe.step_metrics": "rlframe.loop.step_metrics",
    "rlframe.sync_check": "rlframe.loop.sync_check",
    "rlframe.tracking": "rlframe.observability.tracking",
    "rlframe.trainer": "rlframe.loop.trainer",
    "rlframe.validation": "rlframe.loop.validation",
    "workers.engines.base": "workers.inference.base",
    "workers.engines.checkpointing": "workers.training.checkpointing",
    "workers.engines.dtensor_gather": "workers.training.dtensor_gather",
    "workers.engines.fsdp": "workers.training.fsdp",
    "workers.engines.hf_model": "workers.training.hf_model",
    "workers.engines.hf_rollout": "workers.inference.hf_rollout",
    "workers.engines.layout_forward": "workers.training.layout_forward",
    "workers.engines.lora": "workers.training.lora",
    "workers.engines.rank0_load": "workers.training.rank0_load",
    "workers.engines.router_logits": "workers.model_hooks.router_logits",
    "workers.engines.router_replay": "workers.model_hooks.router_replay",
    "workers.engines.token_logprobs": "workers.training.token_logprobs",
    "workers.engines.ulysses": "workers.training.ulysses",
    "workers.engines.vision": "workers.model_hooks.vision",
    "workers.engines.vllm_lora": "workers.inference.vllm_lora",
    "workers.engines.vllm_moe": "workers.inference.vllm_moe",
    "workers.engines.vllm_rollout": "workers.inference.vllm_rollout",
    "workers.engines.weight_names": "workers.model_hooks.weight_names",
    "workers.rollout_role": "workers.roles.rollout_role",
    "workers.sync_probe": "workers.sync.sync_probe",
    "workers.train_role": "workers.roles.train_role",
    "workers.weight_sync": "workers.sync.weight_sync",
}
"""Old module -> new module."""

GONE_PACKAGES = frozenset({"workers.engines"})
"""Packages that no longer exist (their modules moved three ways): found as empty packages,
so that an import of one of their modules reaches :data:`MOVED` by its full name."""


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Raises ModuleNotFoundError naming the new module for an import of a moved one; finds
    nothing for any other name, so the ordinary finders run."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in GONE_PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, None, is_package=True)
        new = MOVED.get(fullname)
        if new is None:
            return None
        raise ModuleNotFoundError(
            f"{fullname} moved to {new} (rlframe 0.2 lays the tree out by concern)",
            name=fullname,
        )


def install_moved_finder() -> None:
    """Put the finder last on ``sys.meta_path`` (once): it is asked only after the real
    finders found nothing."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
