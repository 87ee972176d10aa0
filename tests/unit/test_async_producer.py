"""The experience producer ahead of the trainer: partial responses across syncs, the
staleness bound in both modes, drops, resuming from its state, and staleness 0 as lockstep.
A scripted engine stands in for the rollout group (tests/unit/scripted_engine.py; the real
one runs in tests/e2e/test_async_training.py)."""

from __future__ import annotations

import json

import pytest
import torch

from rlframe.config import Placement
from rlframe.core.protocol import Batch
from rlframe.data.loader import build_prompt_batch
from rlframe.envs import EnvError
from rlframe.rollout import AgentContext, ExperienceProducer, run_single_turn
from rlframe.rollout.engine_client import EngineClient
from tests.rows_grid import collate_rows
from tests.unit.scripted_engine import (
    TOKENIZER,
    Engine,
    StreamEngine,
    make_producer,
    run_steps,
)


@pytest.mark.parametrize("mode", ["wait", "drop"])
def test_partial_responses_cross_syncs_within_the_bound(mode: str) -> None:
    engine = Engine()
    producer = make_producer(engine, k=1, chunk=3, mode=mode)
    steps = run_steps(producer, engine, 8)
    seen_partial = False
    for step, (batch, metrics) in enumerate(steps):
        assert len(batch) == 4
        assert metrics["off_policy/staleness_max"] <= 1
        versions, mask = batch["token_version"], batch["response_mask"].bool()
        # Tokens only ever come from the current or older weights, never newer.
        assert int(versions[mask].max()) <= step
        assert (versions[mask] >= step - 1).all()
        # Every response is complete: stopped by EOS or at max_tokens.
        ends = batch["response_ids"][torch.arange(4), mask.sum(1).long() - 1]
        assert (ends == TOKENIZER.eos_token_id).all()
        seen_partial |= metrics["off_policy/partial_frac"] > 0
        if mode == "wait":
            assert metrics["off_policy/dropped"] == 0
    assert seen_partial
    assert max(m["off_policy/staleness_max"] for _, m in steps) == 1


def test_drop_mode_drops_stragglers_over_the_bound() -> None:
    engine = Engine()
    producer = make_producer(engine, k=1, chunk=1, mode="drop")
    steps = run_steps(producer, engine, 8)
    assert sum(m["off_policy/dropped"] for _, m in steps) > 0
    assert all(m["off_policy/staleness_max"] <= 1 for _, m in steps)


def test_a_sync_continues_no_streamed_group_over_the_bound() -> None:
    """Streamed responses in drop mode: the sync after which a group is over the bound
    drops it before the stream continues what it paused, so no request of it runs on."""
    engine = StreamEngine()
    client = EngineClient([engine])
    producer = make_producer(Engine(), k=1, chunk=0, mode="drop", overlap=True, client=client)
    assert producer.stream is not None

    def sync() -> int:
        engine.version += 1
        return engine.version

    synced = producer.track_sync(sync)
    try:
        engine.gate.clear()  # nothing moves: every admitted group stays unfinished
        producer.launch_call()
        first = {g.group_id for g in producer.groups}
        assert len(first) == 4 and len(producer.stream.in_flight) == 8
        synced()  # version 1: the version-0 groups may still train
        assert {g.group_id for g in producer.groups} >= first
        synced()  # version 2: they are over the bound
        live = producer.groups
        assert first.isdisjoint(g.group_id for g in live)
        assert all(g.start_version == 2 for g in live)
        streamed = [row for row, _, _ in producer.stream.in_flight.values()]
        live_rows = {id(row) for g in live for row in g.rows}
        assert streamed and all(id(row) in live_rows for row in streamed)
        engine.gate.set()
        _, metrics = producer.next_batch()
        assert metrics["off_policy/dropped"] == len(first)
    finally:
        producer.close()


def test_staleness_zero_is_lockstep() -> None:
    """k=0: one step's groups at a time, whole responses, all from the current weights."""
    engine = Engine()
    producer = make_producer(engine, k=0, chunk=0)
    for step, (batch, metrics) in enumerate(run_steps(producer, engine, 4)):
        assert batch["group"].tolist() == [2 * step, 2 * step, 2 * step + 1, 2 * step + 1]
        assert (batch["token_version"] == step).all()  # no token of older weights...
        assert (batch["weights_version"] == step).all()
        assert "off_policy/staleness_max" not in metrics  # ...so no off-policy figures
    assert engine.rows == 4 * 4  # nothing generated ahead


def test_resume_from_state_continues_exactly() -> None:
    engine = Engine()
    straight = make_producer(engine, k=1, chunk=3)
    first = run_steps(straight, engine, 3)
    state = json.loads(json.dumps(straight.state_dict()))
    assert state["groups"], "nothing in flight: the test would not test resuming partials"
    rest = run_steps(straight, engine, 3)

    resumed_engine = Engine()
    resumed_engine.version = 3
    resumed = make_producer(resumed_engine, k=1, chunk=3)
    resumed.load_state_dict(state)
    again = run_steps(resumed, resumed_engine, 3)
    assert len(first) == 3
    for (a, ma), (b, mb) in zip(rest, again):
        for key in ("group", "response_ids", "token_version", "rollout_logprobs", "reward"):
            assert torch.equal(a[key], b[key]), key
        assert ma["off_policy/staleness_mean"] == mb["off_policy/staleness_mean"]


def test_staleness_zero_gives_the_lockstep_batches() -> None:
    """k=0: each step's batch is the single_turn agent's over that step's prompts (one engine
    call, the loader's seeds) with the reward stage's scores: the same groups, seeds,
    responses, log-probs and rewards as a plain lockstep loop, step by step."""
    engine, plain_engine = Engine(), Engine()
    producer = make_producer(engine, k=0, chunk=0)
    plain = make_producer(plain_engine, k=0, chunk=0)
    for step, (batch, metrics) in enumerate(run_steps(producer, engine, 4)):
        prompts = build_prompt_batch(plain.loader.next_records(), 2, 2 * step, 0, 0)
        prompts.meta |= {"stop_token_ids": [TOKENIZER.eos_token_id], "pad_token_id": 0}
        expected = plain.rewards.compute_rewards(plain.generate(prompts))
        plain_engine.version += 1
        for key in ("group", "prompt_ids", "response_ids", "response_mask", "rollout_logprobs"):
            assert torch.equal(batch[key], expected[key]), key
        for key in ("reward", "score", "weights_version", "token_version"):
            assert torch.equal(batch[key], expected[key]), key
        assert batch["seed"].tolist() == expected["seed"].tolist()
        assert list(batch["finish_reason"]) == list(expected["finish_reason"])
        # Lockstep's metrics: no off-policy or idle figures.
        assert set(metrics) == {"timing_s/gen", "timing_s/reward"}


@pytest.mark.parametrize("placement", ["colocated", "separate"])
@pytest.mark.parametrize("agent", ["single_turn", "multi_turn"])
def test_launcher_builds_one_producer(placement: str, agent: str) -> None:
    """One producer at any staleness and for any agent; only a separate pool at k >= 1 runs
    its calls ahead on a thread. The sync the trainer gets records each new version."""
    from rlframe.run.assembly import build_producer

    engine = Engine()
    base = make_producer(engine, k=0, chunk=0)
    cfg = base.cfg
    cfg.rollout.placement = Placement(placement)
    cfg.rollout.agent = agent

    class Workers:
        generate = engine.generate

        @staticmethod
        def sync_weights() -> int:
            engine.version += 1
            return engine.version

    Workers.engine = None  # type: ignore[attr-defined]  # turns gathered into generate calls
    for k in (0, 1):
        cfg.rollout.max_staleness = k
        producer, sync = build_producer(cfg, Workers, TOKENIZER, base.loader, base.rewards)
        assert type(producer) is ExperienceProducer
        assert (producer.thread is not None) == (placement == "separate" and k == 1)
        assert producer.continues == (agent == "single_turn")
        assert sync() == engine.version == producer.version == k + 1
        producer.close()


def test_an_agent_that_returns_a_batch_stops_with_one_line() -> None:
    """The contract before rows (an agent returning its collated Batch) is not adapted: the
    first batch names the agent and what to return instead."""
    producer = make_producer(Engine(), k=0, chunk=0)
    prompts = build_prompt_batch(producer.loader.next_records(), 2, 0, 0, 0)
    prompts.meta |= {"stop_token_ids": [TOKENIZER.eos_token_id], "pad_token_id": 0}

    def old_agent(prompts: Batch, ctx: AgentContext) -> Batch:
        return collate_rows(run_single_turn(prompts, ctx), prompts, 12)

    producer.agent = old_agent  # type: ignore[assignment]
    with pytest.raises(EnvError, match=r"returned a Batch, not a list of TokenRow: an agent"):
        producer.generate(prompts)
    producer.agent = run_single_turn
    assert len(producer.generate(prompts)) == 4
