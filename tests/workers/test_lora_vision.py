"""LoRA on a vision-language model (tiny-vl:0, Qwen2-VL) with a real in-process vLLM engine,
in each sync mode: the adapters sit on the language model only (the vision tower keeps its
loaded weights and never travels), and after an update and a sync vLLM samples image prompts
with the trainer's log-probs (``lp_diff`` < 1e-4), which moved away from the base policy's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rlframe.config.lora import LoraSync
from rlframe.core.train_batch import POLICY_UPDATE, TrainBatch
from tests.vision_rows import make_vision_batch
from tests.workers.cases import build_role, make_lora_vllm_config
from tests.workers.layout_cases import join_one_rank_group

pytestmark = pytest.mark.usefixtures("one_rank_group")

ROWS = 8
CLEAN = 1e-4
"""The rollout/trainer gap of tokens sampled with the trainer's weights (fp32)."""


@pytest.fixture(scope="module", params=[LoraSync.adapter, LoraSync.merged], ids=lambda s: s.value)
def roles(request: pytest.FixtureRequest, vl_path: str):
    from workers.roles.rollout_role import RolloutRole

    # The other sync mode's engine, released before this one is built, took the default
    # process group down with it (vLLM's shutdown destroys it): join a new one.
    join_one_rank_group()
    cfg = make_lora_vllm_config(request.param)
    cfg.model.path = vl_path
    cfg.actor = replace(cfg.actor, mini_batch_size=ROWS, micro_batch_size=ROWS)
    cfg.algorithm = replace(cfg.algorithm, kl_coef=0.0)
    cfg.data.max_prompt_length = 64
    return build_role(vl_path, cfg), RolloutRole(cfg, vl_path, "cpu", 0)


def sample_image_rows(rollout, vl_path: str) -> TrainBatch:
    """Image prompts with the responses vLLM samples for them, as the trainer's rows."""
    from workers.inference.base import SamplingSpec

    # Single-turn rows: vLLM samples a fresh response to each prompt and its images alone.
    batch = make_vision_batch(vl_path, rows=ROWS, seed=3, observation_row=ROWS)
    mask = batch.tensor("prompt_mask").bool()
    prompts = [ids[m].tolist() for ids, m in zip(batch.tensor("prompt_ids"), mask, strict=True)]
    spec = SamplingSpec(max_tokens=5, temperature=1.0, top_p=1.0, stop_token_ids=())
    images = [list(r) for r in batch.column("images")]
    samples = rollout.engine.generate(prompts, list(range(ROWS)), spec, images)
    response_ids = torch.zeros(ROWS, 5, dtype=torch.long)
    logprobs, response_mask = torch.zeros(ROWS, 5), torch.zeros(ROWS, 5)
    for i, s in enumerate(samples):
        response_ids[i, : len(s.response_ids)] = torch.tensor(s.response_ids)
        logprobs[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
        response_mask[i, : len(s.response_ids)] = 1
    return replace(
        POLICY_UPDATE.build(batch),
        response_ids=response_ids,
        response_mask=response_mask,
        loss_mask=response_mask.clone(),
        rollout_logprobs=logprobs,
    )


def train_on_images(train, vl_path: str, steps: int = 3) -> None:
    """On-policy updates on image rows with random advantages."""
    for step in range(steps):
        batch = POLICY_UPDATE.build(make_vision_batch(vl_path, rows=ROWS, seed=10 + step))
        g = torch.Generator().manual_seed(step)
        advantages = torch.randn(ROWS, 1, generator=g) * batch.loss_mask
        batch = replace(batch, advantages=advantages)
        train.update(replace(batch, old_logprobs=train.compute_logprobs(batch)))


def test_lora_on_the_language_model_syncs_image_logprobs(roles, vl_path: str) -> None:
    from workers.sync.weight_sync import InProcessSink
    from workers.training.lora import list_lora_layers

    train, rollout = roles
    adapted = list(list_lora_layers(train.actor.model))
    assert adapted and all(".language_model.layers." in n for n in adapted), adapted
    names = [name for name, _ in train.weight_source().iter_tensors()]
    assert names and not any(".visual." in n for n in names)
    if train.lora.sync is LoraSync.adapter:
        assert all(".lora_A." in n or ".lora_B." in n for n in names)
    else:
        assert not any("lora" in n for n in names) and "lm_head.weight" in names

    rollout.verify_weights(train.compute_sync_probe())  # the base on both sides
    train_on_images(train, vl_path)
    version = train.publish_weights()
    InProcessSink(rollout).push(train.weight_source(), version)
    rollout.verify_weights(train.compute_sync_probe())

    rows = sample_image_rows(rollout, vl_path)
    sampled = rows.rollout_logprobs
    mask = rows.loss_mask.bool()
    trainer = train.compute_logprobs(rows)
    base = train.compute_ref_logprobs(rows)  # the adapters off
    lp_diff = float((sampled - trainer)[mask].abs().max())
    moved = float((base - trainer)[mask].abs().max())
    print(f"{train.lora.sync.value} sync: lp_diff {lp_diff:.2e}, adapters moved {moved:.2e}")
    assert lp_diff < CLEAN and moved > 100 * CLEAN
