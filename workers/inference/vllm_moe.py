"""vLLM 0.32's CPU MoE kernels after an in-place weight reload.

On the first load, vLLM's unquantized fused-MoE method builds its kernel and lets the CPU
experts (``CPUUnquantizedExperts``) prepack ``w13_weight`` / ``w2_weight`` into the layout
its grouped GEMM reads. On a reload (``reload_weights``, every sync) it sees the kernel
already built, takes it for a weight update, copies the new weights into the old storage in
checkpoint layout and skips the prepack: the engine then reads plain [experts, out, in]
tensors as prepacked ones. Nothing fails; the rollout samples from scrambled experts
(tiny-moe: log-prob gap 6e-3 after a sync of unchanged weights, 1e-6 before). Forgetting the
kernel before the reload sends the layer through the first-load path again, which prepacks.
"""

from __future__ import annotations

from typing import Any


def forget_moe_kernels(worker: Any) -> int:
    """Drop the built kernel of every unquantized fused-MoE layer of ``worker``'s model, so
    that the next ``reload_weights`` rebuilds it from the reloaded weights (and prepacks
    them on CPU); returns how many were dropped. Run on the engine's worker
    (``LLM.collective_rpc``)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    dropped = 0
    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedFusedMoEMethod) and method.moe_kernel is not None:
            method.moe_kernel = None
            dropped += 1
    return dropped
