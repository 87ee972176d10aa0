"""The LoRA weight sync into a real in-process vLLM engine (one gloo rank, as a hybrid worker
holds them) and its receiver check: the engine's probe log-probs match the trainer's after a
sync, and a deliberately stale sync is caught and named."""

from __future__ import annotations

import pytest
import torch

from rlframe.config.lora import LoraSync
from tests.workers.cases import build_role, make_batch, make_lora_vllm_config


@pytest.fixture(scope="module")
def roles(model_path: str, one_rank_group: None):
    from workers.roles.rollout_role import RolloutRole

    cfg = make_lora_vllm_config(LoraSync.merged)
    train = build_role(model_path, cfg)
    rollout = RolloutRole(cfg, model_path, "cpu", 0)
    return train, rollout


def sync(train, rollout) -> int:
    from workers.sync.weight_sync import InProcessSink

    version = train.publish_weights()
    probe = train.compute_sync_probe()
    InProcessSink(rollout).push(train.weight_source(), version)
    rollout.verify_weights(probe)
    return version


def test_merged_sync_matches_the_trainer_and_a_stale_one_is_caught(roles) -> None:
    from workers.sync.sync_probe import StaleWeightsError

    train, rollout = roles
    rollout.verify_weights(train.compute_sync_probe())  # version 0: the base on both sides
    first = rollout.last_probe.logprobs
    for _ in range(3):
        train.update(make_batch())
    sync(train, rollout)
    after = rollout.last_probe
    probe = train.compute_sync_probe()
    # The engine now serves the trained adapter, merged: fp32 agreement with the trainer.
    assert float((after.logprobs - probe.logprobs).abs().max()) < 1e-4
    assert float((after.logprobs - first).abs().max()) > 1e-2
    stale = [(n, t.clone()) for n, t in train.weight_source().iter_tensors()]  # version 1
    for _ in range(3):
        train.update(make_batch(seed=1))
    version = train.publish_weights()
    # A sink that delivers the previous version's tensors under the new version.
    rollout.load_weights(iter(stale), version)
    with pytest.raises(StaleWeightsError, match=f"version {version}.*equal version 1's"):
        rollout.verify_weights(train.compute_sync_probe())
    # The real sync of the same version passes.
    push_version(train, rollout, version)
    rollout.verify_weights(train.compute_sync_probe())


def push_version(train, rollout, version: int) -> None:
    from workers.sync.weight_sync import InProcessSink

    InProcessSink(rollout).push(train.weight_source(), version)


def test_merged_sync_streams_plain_hf_names(roles) -> None:
    train, _ = roles
    names = [name for name, _ in train.weight_source().iter_tensors()]
    assert names and not [n for n in names if "lora" in n or "base_layer" in n]
    assert all(not n.startswith("base_model") for n in names)
    assert torch.is_tensor(train.compute_sync_probe().logprobs)
