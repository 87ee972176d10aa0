"""Multi-turn episodes through the real engine: two hybrid workers (vLLM + FSDP2) on Ray,
the guess-the-number env on the driver."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
import torch

from rlframe.config import Config
from rlframe.core.protocol import Batch
from rlframe.envs import ChatFormat
from rlframe.rollout import AgentContext, run_single_turn
from rlframe.rollout.engine_client import EngineClient, connect_ray_replicas
from rlframe.rollout.multi_turn import mix_seed, run_episodes
from rlframe.rollout.turns import TurnRequest, TurnResult
from tests.ray.factories import prompts_for, tiny_config
from tests.rows_grid import run_agent

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]

WORLD = 2


def make_config(max_turns: int) -> Config:
    agent = {
        "env": "guess_number",
        "env_kwargs": {"hint_format": " {hint}:"},
        "max_turns": max_turns,
        "max_tokens_per_turn": 2,
        "close_cut_turns": True,
        "max_obs_tokens": 16,
    }
    return tiny_config(WORLD, data={"task": "guess"}, rollout={"agent": "multi_turn"}, agent=agent)


class Recorder:
    """Passes calls through to the worker group's generate and keeps what went in and out."""

    def __init__(self, generate: Any) -> None:
        self.generate, self.calls = generate, []

    def __call__(self, batch: Batch) -> Batch:
        out = self.generate(batch)
        self.calls.append((batch, out))
        return out


def test_episodes_concatenate_engine_ids_and_logprobs_match_the_trainer(
    tiny_hybrid_group, tiny_model_path: str
) -> None:
    from transformers import AutoTokenizer

    cfg = make_config(max_turns=3)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    group = tiny_hybrid_group(cfg)
    prompts = prompts_for(3, task="guess", tokenizer=tokenizer)
    recorder = Recorder(group.generate)
    batch = run_agent(run_episodes, prompts, AgentContext(recorder, tokenizer, cfg))

    # Every engine call's input is the row's prompt + response so far, and what the engine
    # sampled sits unchanged, with its log-probs, right after it in the final response.
    seeds = [int(s) for s in prompts["seed"]]
    for inputs, out in recorder.calls:
        for j in range(len(inputs)):
            row = next(
                r
                for r, s in enumerate(seeds)
                for turn in range(3)
                if mix_seed(s, turn) == int(inputs["seed"][j])
            )
            prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
            response = batch["response_ids"][row].tolist()
            context = list(inputs["prompt_tokens"][j])
            start = len(context) - len(prompt)
            assert context == prompt + response[:start]
            n = len(out["response_tokens"][j])
            assert list(out["response_tokens"][j]) == response[start : start + n]
            assert batch["loss_mask"][row, start : start + n].eq(1).all()
            assert torch.equal(
                torch.tensor(out["token_logprobs"][j]),
                batch["rollout_logprobs"][row, start : start + n],
            )
    assert len(recorder.calls) >= 2 and batch["agent_turns"].max() >= 2

    # Observations are the template's suffix of the env's feedback (after <eos> closing
    # the turn).
    chat = ChatFormat(tokenizer)
    hints = {
        tuple(chat.observation_ids([{"role": "user", "content": f" {h}:"}], 16)[0])
        for h in ("higher", "lower", "invalid")
    }
    for row in range(len(batch)):
        obs = (batch["response_mask"][row] - batch["loss_mask"][row]).bool()
        segments = torch.nonzero(obs).squeeze(-1).tolist()
        runs = split_runs(segments)
        for run in runs:
            ids = batch["response_ids"][row, run].tolist()
            ids = ids[1:] if ids[0] == tokenizer.eos_token_id else ids
            assert tuple(ids) in hints

    trainer = group.compute_logprobs(batch)["old_logprobs"]
    mask = batch["loss_mask"]
    gap = float(((trainer - batch["rollout_logprobs"]).abs() * mask).max())
    print(
        f"multi-turn x{WORLD}: {int(mask.sum())} sampled tokens, "
        f"{int((batch['response_mask'] - mask).sum())} observation tokens, "
        f"turns/mean {batch['agent_turns'].mean():.2f}, "
        f"max |trainer - vLLM| log-prob {gap:.2e}"
    )
    assert gap < 1e-4

    # A one-turn episode samples what single_turn samples (same seed, same context).
    single_cfg = make_config(max_turns=1)
    single_cfg.agent.max_tokens_per_turn = 0
    one = run_agent(run_episodes, prompts, AgentContext(group.generate, tokenizer, single_cfg))
    plain = run_agent(run_single_turn, prompts, AgentContext(group.generate, tokenizer, single_cfg))
    assert torch.equal(one["response_ids"][:, :6], plain["response_ids"])
    assert torch.equal(one["loss_mask"][:, :6], plain["loss_mask"])


class RecordingServer:
    """The engine client, recording which rank served each session's turns."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.served: dict[str, list[int]] = {}

    def open(self) -> None:
        self.client.open()

    def submit(self, request: TurnRequest, session: str) -> Future[TurnResult]:
        future = self.client.submit(request, session)
        future.add_done_callback(
            lambda f: self.served.setdefault(session, []).append(f.result().rank)
        )
        return future

    def end_session(self, session: str) -> None:
        self.client.end_session(session)

    def take_metrics(self) -> dict[str, float]:
        return self.client.take_metrics()

    def close(self) -> None:
        self.client.close()


def test_streamed_episodes_stay_on_one_replica_and_match_the_trainer(
    tiny_hybrid_group, tiny_model_path: str
) -> None:
    """Episodes as coroutines through the request stream over 2 engine replicas: every turn
    of an episode is served by the replica of its first turn, new episodes spread over both,
    and the sampled log-probs are the trainer's."""
    from transformers import AutoTokenizer

    cfg = make_config(max_turns=3)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    group = tiny_hybrid_group(cfg)
    replicas = connect_ray_replicas(group.role, group.actors, 1, 600)
    server = RecordingServer(EngineClient(replicas, group.open_stream))
    try:
        prompts = prompts_for(4, task="guess", tokenizer=tokenizer)
        batch = run_agent(
            run_episodes, prompts, AgentContext(group.generate, tokenizer, cfg, engine=server)
        )
        metrics = server.take_metrics()
    finally:
        server.close()
    turns = batch["agent_turns"].tolist()
    assert sorted(len(ranks) for ranks in server.served.values()) == sorted(turns)
    assert max(turns) >= 2
    assert all(len(set(ranks)) == 1 for ranks in server.served.values()), server.served
    firsts = [ranks[0] for ranks in server.served.values()]
    assert set(firsts) == {0, 1}
    assert metrics["rollout/requests/replica_0"] + metrics["rollout/requests/replica_1"] == sum(
        turns
    )
    trainer = group.compute_logprobs(batch)["old_logprobs"]
    mask = batch["loss_mask"]
    gap = float(((trainer - batch["rollout_logprobs"]).abs() * mask).max())
    print(
        f"streamed multi-turn x2 replicas: {len(firsts)} episodes, "
        f"{firsts.count(0)}/{firsts.count(1)} on replica 0/1, {sum(turns):.0f} turns, "
        f"prefix cache hit {metrics.get('rollout/prefix_cache_hit', float('nan')):.3f}, "
        f"max |trainer - vLLM| log-prob {gap:.2e}"
    )
    assert gap < 1e-4


def split_runs(positions: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for p in positions:
        if runs and runs[-1][-1] == p - 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs
