"""The vLLM engine's arguments and environment on CUDA, checked against vLLM's own parsers
(``EngineArgs``, ``vllm.envs``) without starting an engine: the CUDA branches never run on
the CPU suite's engines."""

from __future__ import annotations

import torch

from rlframe.config import RolloutConfig
from workers.engines.vllm_rollout import build_engine_args


def test_cuda_engine_turns_custom_all_reduce_off() -> None:
    # Each Ray actor sees one GPU: vLLM's custom all-reduce would index past
    # CUDA_VISIBLE_DEVICES at engine start with TP >= 2 (desk check item 1).
    from vllm.engine.arg_utils import EngineArgs

    cfg = RolloutConfig(tensor_parallel_size=2)
    args = build_engine_args("/nonexistent", cfg, "cuda", 256, 0, torch.bfloat16)
    parsed = EngineArgs(**args)  # every key is one vLLM 0.32 knows
    assert parsed.disable_custom_all_reduce is True
    assert parsed.distributed_executor_backend == "external_launcher"
    assert parsed.enable_sleep_mode is True


def test_cpu_engine_args_are_valid_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    args = build_engine_args("/nonexistent", RolloutConfig(), "cpu", 256, 0, torch.float32)
    assert EngineArgs(**args).max_num_seqs == args["max_num_seqs"]
