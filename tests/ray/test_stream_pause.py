"""Partial rollouts by abort and continuation, through the real engine: a hybrid worker
(vLLM + FSDP2) on Ray serves single-turn responses as requests of the stream
(:class:`rlframe.rollout.response_stream.ResponseStream`); a pause (what a weight sync does)
ends them part-way, the engine keeps none of them, and their continuations complete them.
Every token of a response stitched from two requests carries the log-prob the trainer
gives it."""

from __future__ import annotations

import pytest
import ray

from rlframe.controller.worker_group import WorkerError
from rlframe.rollout.engine_client import EngineClient, connect_ray_replicas
from rlframe.rollout.response_stream import ResponseStream
from rlframe.rollout.rows import collate, read_prompt_rows
from tests.ray.factories import logprob_gap, prompts_for, tiny_config

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]

MAX_TOKENS = 96
"""Long enough that the responses not ended by a stop token are part-way when the first
answer comes (one engine call of at most ``STEPS_PER_CALL`` steps later)."""


def test_a_paused_response_continues_with_the_trainers_logprobs(
    tiny_hybrid_group, tiny_model_path: str
) -> None:
    from transformers import AutoTokenizer

    cfg = tiny_config(1, rollout={"max_tokens": MAX_TOKENS})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    group = tiny_hybrid_group(cfg)
    client = EngineClient(connect_ray_replicas(group.role, group.actors, 1, 600), group.open_stream)
    try:
        prompts = prompts_for(5, tokenizer=tokenizer)
        rows = read_prompt_rows(prompts)
        stream = ResponseStream(client, MAX_TOKENS, (int(tokenizer.eos_token_id),))
        stream.submit(rows)
        stream.wait()  # the first answer: the others are some steps into their responses
        # A blocking call while the stream's requests are in the engine would step them and
        # take their outputs: refused (the producer pauses the stream before one).
        with pytest.raises(WorkerError, match="pause the stream"):
            group.generate(prompts)
        stream.pause()
        cut = [len(r.response_ids) for r in rows if r.finish_reason is None]
        # The engine holds nothing after the pause: a call without requests finishes none.
        assert ray.get(group.actors[0].serve.remote([])) == []
        assert not stream.in_flight
        stream.submit(rows)  # the continuations
        while stream.in_flight:
            stream.wait()
    finally:
        client.close()
    assert cut and all(0 < n < MAX_TOKENS for n in cut), cut
    stitched = [r for r in rows if r.turns == 2]
    assert len(stitched) == len(cut)
    assert all(r.finish_reason in ("stop", "length") for r in rows)
    batch = collate(rows, prompts.rows(list(range(len(rows)))), MAX_TOKENS, tokenizer.pad_token_id)
    gap = logprob_gap(batch, group.compute_logprobs(batch)["old_logprobs"])
    print(
        f"paused {len(cut)} of {len(rows)} responses at {min(cut)}-{max(cut)} tokens; "
        f"max |trainer - vLLM| log-prob over the stitched responses {gap:.2e}"
    )
    assert gap < 1e-4
