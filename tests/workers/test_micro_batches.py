"""The gradient of a mini-batch does not depend on how it is cut: row-count or token-budget
micro-batches, packed or padded, chunked or not, one rank or two, in every loss_agg mode.
And an on-policy update without an old-log-prob pass is the update with one."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.workers.layout_cases import LOSS_AGGS, make_batch, make_config
from tests.workers.rank_grads import compute_case_grads, run_two_ranks

# Each a different cut of the same 16 rows (longest row 15 tokens, 3 to 15 when packed).
PARTITIONS = [
    {"micro": 4},
    {"micro": 1, "packed": False, "chunk": 2},
    {"budget": 15},
    {"budget": 40, "chunk": 3},
    {"budget": 31, "packed": False},
]


pytestmark = pytest.mark.usefixtures("one_rank_group")


def test_budgets_make_different_micro_batches() -> None:
    from workers.training.fsdp import split_micro_batches

    batch = make_batch()
    counts = {}
    for case in [{"micro": 16}, *PARTITIONS]:
        cfg = make_config(**case).actor
        parts = split_micro_batches(batch, cfg, "cpu", bool(cfg.pack_sequences))
        # Every row exactly once.
        seen = sorted(tuple(row.tolist()) for p in parts for row in p.response_ids)
        assert seen == sorted(tuple(row.tolist()) for row in batch.response_ids)
        if cfg.max_tokens_per_micro_batch:
            costs = (
                p.prompt_mask.sum() + p.response_mask.sum() if cfg.pack_sequences else 15 * len(p)
                for p in parts
            )
            assert all(
                c <= cfg.max_tokens_per_micro_batch or len(p) == 1 for c, p in zip(costs, parts)
            )
        counts[str(case)] = len(parts)
    print(counts)
    assert len(set(counts.values())) >= 4


@pytest.mark.slow
@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_gradient_does_not_depend_on_partition(model_path: str, loss_agg: str) -> None:
    want = compute_case_grads(
        {"loss_agg": loss_agg, "micro": 16, "packed": False}, model_path, 0, 1
    )
    assert want.abs().max() > 1e-3
    for case in PARTITIONS:
        got = compute_case_grads({"loss_agg": loss_agg, **case}, model_path, 0, 1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{case}: {m}")


@pytest.mark.slow
def test_two_ranks_give_the_one_rank_gradient(model_path: str, tmp_path) -> None:
    cases = [{"loss_agg": mode, "micro": 8} for mode in LOSS_AGGS]
    cases += [
        {"loss_agg": "seq-mean-token-mean", "budget": 20, "chunk": 4},
        {"loss_agg": "token-mean", "budget": 15, "packed": False},
    ]
    out = tmp_path / "grads.pt"
    two_ranks = run_two_ranks(model_path, cases, str(out))
    for case, got in zip(cases, two_ranks):
        want = compute_case_grads(case, model_path, 0, 1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{case}: {m}")


def test_on_policy_update_without_old_logprob_pass(model_path: str) -> None:
    from workers.train_worker import TrainWorker

    cfg = make_config(budget=24, chunk=5, kl_coef=0.0)
    batch = make_batch()
    batch = replace(batch, old_logprobs=None)
    with_pass = TrainWorker(cfg, model_path, "cpu")
    old = with_pass.compute_logprobs(batch)["old_logprobs"]
    want = with_pass.update(replace(batch, old_logprobs=old)).metrics
    result = TrainWorker(cfg, model_path, "cpu").update(batch)
    got = result.metrics
    mask = batch.loss_mask.bool()
    assert bool((old[mask] < 0).all())
    assert want.keys() == got.keys()
    torch.testing.assert_close(result.own_logprobs, old, atol=1e-5, rtol=1e-5)
    assert got["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-5)
    assert got["actor/ppo_kl"] == 0.0 and abs(want["actor/ppo_kl"]) < 1e-6


def test_update_without_old_logprobs_refuses_a_second_pass(model_path: str) -> None:
    from rlframe.config import ActorConfig
    from workers.roles.train_role import check_single_pass

    check_single_pass(16, ActorConfig(mini_batch_size=16, micro_batch_size=4), 1)
    with pytest.raises(ValueError, match="on-policy"):
        check_single_pass(16, ActorConfig(mini_batch_size=8, micro_batch_size=4), 1)
    with pytest.raises(ValueError, match="on-policy"):
        check_single_pass(16, ActorConfig(mini_batch_size=16, micro_batch_size=4, epochs=2), 1)
