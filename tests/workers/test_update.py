"""The training update on a real FSDP2 engine: one rank in this process (gloo), and two
ranks in two spawned processes for what depends on the rank count."""

from __future__ import annotations

import io
import math
import multiprocessing
import os
import socket
from dataclasses import replace
from typing import Any

import pytest
import torch

from rlframe.data.tiny_model import resolve_model_path
from tests.workers.cases import (
    UPDATE_LR,
    assert_same_gradient,
    gather_weights,
    make_batch,
    make_update_config,
    record_step_grads,
    with_critic_targets,
)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return resolve_model_path("tiny:0", cache_dir=tmp_path_factory.mktemp("models"))


LOSS_AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
GRADIENT_ULPS = 32
"""Bound on a gradient summed in another order (micro-batches, ranks), in fp32 ulps of its
largest element (see tests.workers.cases.assert_same_gradient). Measured: at most 3.4
(micro-batches: 3 batch seeds x 3 loss aggregations; ranks: 1.2; 1 and 2 threads). The
gradients, not the weights after the AdamW step, are compared: Adam moves a weight by about
lr whatever its gradient's size, so a near-zero gradient whose rounding differs on another
CPU moves its weight by up to 2 lr."""


def find_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_rank_env(rank: int, world: int, port: int) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )


@pytest.fixture(scope="module", autouse=True)
def single_rank_group() -> None:
    """A one-rank gloo process group for this process, as a worker would have."""
    set_rank_env(0, 1, find_free_port())


def update_once(
    model_path: str, micro: int, loss_agg: str
) -> tuple[dict[str, float], torch.Tensor, torch.Tensor, torch.Tensor]:
    """One actor update on the whole batch in this process: its metrics, the gradient the
    optimizer applied, the weights before and after."""
    from workers.train_worker import TrainWorker

    worker = TrainWorker(make_update_config(micro, loss_agg, kl_coef=0.1), model_path, "cpu")
    actor = worker.train_role.actor
    before = gather_weights(actor.model)
    with record_step_grads(actor.optimizer) as steps:
        metrics = worker.update(make_batch()).metrics
    return metrics, steps[0], before, gather_weights(actor.model)


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_update_does_not_depend_on_micro_batch_size(model_path: str, loss_agg: str) -> None:
    whole, g_whole, w_start, w_whole = update_once(model_path, 16, loss_agg)
    split, g_split, _, _ = update_once(model_path, 4, loss_agg)
    print(
        f"{loss_agg}: grad_norm micro=16 {whole['actor/grad_norm']:.6f} "
        f"micro=4 {split['actor/grad_norm']:.6f}"
    )
    assert whole["actor/grad_norm"] > 0 and whole["actor/skipped_steps"] == 0
    assert_same_gradient(g_split, g_whole, ulps=GRADIENT_ULPS)
    assert whole["actor/grad_norm"] == pytest.approx(split["actor/grad_norm"], rel=1e-5)
    # The optimizer stepped: AdamW's first step moves each weight by about lr (m / sqrt(v) is
    # +-1 for any gradient well above eps), so the largest move is lr.
    assert float((w_whole - w_start).abs().max()) == pytest.approx(UPDATE_LR, rel=0.05)
    assert whole["actor/kl"] > 0 and "actor/pg_clipfrac" in whole


def run_rank(rank: int, port: int, model_path: str, results: Any) -> None:
    """One of two ranks (a spawned process): for every loss aggregation, an actor update on
    this rank's half of the batch (the contiguous chunk DP_SPLIT would send), then a critic
    update (each with the whole gradient the optimizer applied), then the lazy-gather check
    of the weight stream. Rank 0 reports."""
    os.environ["OMP_NUM_THREADS"] = "1"
    set_rank_env(rank, 2, port)
    from workers.critic import CriticWorker
    from workers.train_worker import TrainWorker

    out: dict[str, Any] = {}
    try:
        for loss_agg in LOSS_AGGS:
            worker = TrainWorker(
                make_update_config(4, loss_agg, kl_coef=0.1, ranks=2), model_path, "cpu"
            )
            with record_step_grads(worker.train_role.actor.optimizer) as steps:
                metrics = worker.update(make_batch().chunk(2)[rank]).metrics
            out[loss_agg] = (metrics, steps[0])
        critic = CriticWorker(make_update_config(4, "token-mean", ranks=2), model_path, "cpu")
        with record_step_grads(critic.engine.optimizer) as steps:
            metrics = critic.update(with_critic_targets(make_batch()).chunk(2)[rank])
        out["critic"] = (metrics, steps[0])
        out["stream"] = stream_after_zeroing(worker.train_role)
    except Exception as e:  # reported to the test, which would otherwise wait for nothing
        out["error"] = f"rank {rank}: {type(e).__name__}: {e}"
    if rank == 0 or "error" in out:
        # As bytes: a tensor sent through a queue would live in the exiting child's shared memory.
        buffer = io.BytesIO()
        torch.save(out, buffer)
        results.put(buffer.getvalue())


def stream_after_zeroing(role: Any) -> tuple[str, float, list[float]]:
    """Take the first tensor of the weight stream (1-byte buckets: one tensor each), then zero
    every parameter shard, then drain the stream. A stream that gathers bucket by bucket
    yields zeros after the first tensor; one that gathered everything up front does not."""
    from workers.sync.weight_sync import WeightSource

    stream = WeightSource(role.actor.model, bucket_bytes=1).iter_tensors()
    name, first = next(stream)
    first = first.clone()
    with torch.no_grad():
        for p in role.actor.model.parameters():
            p.zero_()
    rest = [float(t.abs().max()) for _, t in stream]
    return name, float(first.abs().max()), rest


@pytest.fixture(scope="module")
def two_rank_results(model_path: str) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(target=run_rank, args=(rank, port, model_path, results)) for rank in range(2)
    ]
    for p in procs:
        p.start()
    try:
        out = torch.load(io.BytesIO(results.get(timeout=600)), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert "error" not in out, out["error"]
    return out


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_update_does_not_depend_on_rank_count(
    model_path: str, two_rank_results: dict[str, Any], loss_agg: str
) -> None:
    """Two ranks with half the batch each make the same step as one rank with all of it: the
    loss is normalised by the global token/sequence counts and scaled by the world size,
    because FSDP averages the ranks' gradients."""
    one, g_one, _, _ = update_once(model_path, 4, loss_agg)
    two, g_two = two_rank_results[loss_agg]
    print(
        f"{loss_agg}: grad_norm 1 rank {one['actor/grad_norm']:.6f} "
        f"2 ranks {two['actor/grad_norm']:.6f}"
    )
    assert_same_gradient(g_two, g_one, ulps=GRADIENT_ULPS)
    assert two["actor/grad_norm"] == pytest.approx(one["actor/grad_norm"], rel=1e-5)


def test_critic_update_does_not_depend_on_rank_count(
    model_path: str, two_rank_results: dict[str, Any]
) -> None:
    from workers.critic import CriticWorker

    critic = CriticWorker(make_update_config(4, "token-mean"), model_path, "cpu")
    with record_step_grads(critic.engine.optimizer) as steps:
        one = critic.update(with_critic_targets(make_batch()))
    two, g_two = two_rank_results["critic"]
    assert one["critic/grad_norm"] > 0 and 0 < one["critic/vf_clipfrac"] < 1
    assert_same_gradient(g_two, steps[0], ulps=GRADIENT_ULPS)
    assert two["critic/grad_norm"] == pytest.approx(one["critic/grad_norm"], rel=1e-5)


def test_weight_stream_gathers_bucket_by_bucket(two_rank_results: dict[str, Any]) -> None:
    name, first, rest = two_rank_results["stream"]
    assert first > 0, name
    assert len(rest) > 5 and max(rest) == 0, (
        "tensors after the first bucket were gathered before it was consumed"
    )


def test_non_finite_gradient_skips_the_optimizer_step(model_path: str) -> None:
    from workers.train_worker import TrainWorker

    worker = TrainWorker(make_update_config(4, "token-mean"), model_path, "cpu")
    start = gather_weights(worker.train_role.actor.model)
    poisoned = make_batch()
    poisoned.advantages[0, 0] = float("nan")  # a real (unmasked) token of row 0
    metrics = worker.update(poisoned).metrics
    assert not math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/skipped_steps"] == 1
    assert torch.equal(gather_weights(worker.train_role.actor.model), start), (
        "a NaN gradient reached the weights"
    )
    # The skipped step left no NaN behind (gradients, Adam state): the next update is clean.
    metrics = worker.update(make_batch()).metrics
    after = gather_weights(worker.train_role.actor.model)
    assert metrics["actor/skipped_steps"] == 0 and torch.isfinite(after).all()
    assert float((after - start).abs().max()) == pytest.approx(UPDATE_LR, rel=0.05)


def test_critic_value_at_t_sees_tokens_up_to_t_only(model_path: str) -> None:
    """values[:, j] is the value of the state before response token j: the model's output at
    the position of token j - 1. Changing token j must leave values[:, :j + 1] unchanged and
    change values[:, j + 1]."""
    from workers.critic import CriticWorker

    critic = CriticWorker(make_update_config(4, "token-mean"), model_path, "cpu")
    batch = make_batch()
    full = torch.ones_like(batch.response_mask)
    batch = replace(batch, response_mask=full, loss_mask=full)
    values = critic.compute_values(batch)["values"]
    j = 2
    changed_ids = batch.response_ids.clone()
    changed_ids[:, j] = 3 + (changed_ids[:, j] - 3 + 1) % 37  # another token, same range
    changed = critic.compute_values(replace(batch, response_ids=changed_ids))["values"]
    torch.testing.assert_close(changed[:, : j + 1], values[:, : j + 1], atol=1e-6, rtol=0)
    assert ((changed[:, j + 1] - values[:, j + 1]).abs() > 1e-6).all()
    # The first value comes from the last prompt position: it changes with the prompt.
    prompt_ids = batch.prompt_ids.clone()
    prompt_ids[:, -1] = 3 + (prompt_ids[:, -1] - 3 + 1) % 37
    moved = critic.compute_values(replace(batch, prompt_ids=prompt_ids))["values"]
    assert ((moved[:, 0] - values[:, 0]).abs() > 1e-6).all()
