"""The hybrid worker on a real Ray cluster: vLLM rollout + FSDP2 training on each rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlframe.data.tiny_model import build_tiny_tokenizer
from tests.ray.factories import logprob_gap, prompts_for, tiny_config
from tests.rows_grid import generate_batch

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]

MAX_TOKENS = 6


def check_rollout(batch, eos: int) -> None:
    lengths = batch["response_mask"].sum(1).long()
    assert (lengths >= 1).all() and (lengths <= MAX_TOKENS).all()
    for ids, n, reason in zip(batch["response_ids"], lengths, batch["finish_reason"]):
        # Generation ends at EOS (kept as the last token) or at max_tokens.
        assert (reason == "stop") == (int(ids[n - 1]) == eos)
        assert reason == "stop" or n == MAX_TOKENS


@pytest.mark.parametrize("engine,world", [("vllm", 2), ("hf", 1)])
def test_rollout_and_trainer_logprobs_agree_before_and_after_sync(
    tiny_hybrid_group, tiny_model_path: str, engine: str, world: int
) -> None:
    # 1 MiB buckets: the tiny model's 1.2 MB of weights take two buckets per sync.
    cfg = tiny_config(
        world, rollout={"engine": engine, "weight_sync_bucket_mb": 1}, algorithm={"kl_coef": 0.01}
    )
    assert (Path(tiny_model_path) / "model.safetensors").stat().st_size > 2**20
    group = tiny_hybrid_group(cfg)
    eos = build_tiny_tokenizer().eos_token_id
    prompts = prompts_for(1)
    batch = generate_batch(group.generate, prompts, MAX_TOKENS)
    check_rollout(batch, eos)
    before = group.compute_logprobs(batch)["old_logprobs"]
    gap_before = logprob_gap(batch, before)

    # One update with a strong signal moves the weights; the sync must carry the move.
    mask = batch["response_mask"]
    train = batch.with_tensors(
        old_logprobs=before, advantages=torch.linspace(-1, 1, len(batch))[:, None] * mask
    ).union(group.compute_ref_logprobs(batch))
    metrics = group.update(train)
    assert len(metrics) == world and all(m.metrics["actor/grad_norm"] > 0 for m in metrics)

    # Before the sync the engine still samples from the old weights: the gap shows it.
    stale_prompts = prompts_for(3)
    stale = generate_batch(group.generate, stale_prompts, MAX_TOKENS)
    gap_stale = logprob_gap(stale, group.compute_logprobs(stale)["old_logprobs"])
    assert gap_stale > 1e-3, "a stale rollout engine must show in the log-prob gap"
    assert group.sync_weights() == [1] * world

    after_update = group.compute_logprobs(batch)["old_logprobs"]
    assert float(((after_update - before).abs() * mask).max()) > 1e-3, (
        "the update did not change the policy"
    )

    prompts2 = prompts_for(2)
    batch2 = generate_batch(group.generate, prompts2, MAX_TOKENS)
    assert batch2["weights_version"].eq(1).all()
    gap_after = logprob_gap(batch2, group.compute_logprobs(batch2)["old_logprobs"])

    # A second step: the engine goes stale again after the next update, not only the first,
    # and the second sync (again several buckets) brings it back.
    before2 = group.compute_logprobs(batch2)["old_logprobs"]
    train2 = batch2.with_tensors(
        old_logprobs=before2,
        advantages=-torch.linspace(-1, 1, len(batch2))[:, None] * batch2["response_mask"],
    ).union(group.compute_ref_logprobs(batch2))
    group.update(train2)
    stale2_prompts = prompts_for(4)
    stale2 = generate_batch(group.generate, stale2_prompts, MAX_TOKENS)
    assert stale2["weights_version"].eq(1).all()
    gap_stale2 = logprob_gap(stale2, group.compute_logprobs(stale2)["old_logprobs"])
    assert gap_stale2 > 1e-3, "a stale rollout engine must show in the log-prob gap at step 2 too"
    assert group.sync_weights() == [2] * world
    prompts3 = prompts_for(5)
    batch3 = generate_batch(group.generate, prompts3, MAX_TOKENS)
    assert batch3["weights_version"].eq(2).all()
    gap_after2 = logprob_gap(batch3, group.compute_logprobs(batch3)["old_logprobs"])
    print(
        f"{engine} x{world}: max |rollout - trainer| log-prob gap: fresh {gap_before:.2e}, "
        f"stale (update without sync) {gap_stale:.2e}, after sync {gap_after:.2e}, "
        f"stale at step 2 {gap_stale2:.2e}, after the second sync {gap_after2:.2e}"
    )
    assert gap_before < 1e-4 and gap_after < 1e-4 and gap_after2 < 1e-4
