"""The OpenAI-compatible endpoint's cost: overhead per call, and concurrent sessions.

One engine in this process (the tiny model; ``--engine vllm``, the training engine, or
``hf``), the RolloutRole the workers hold, and the real ``openai`` client:

1. overhead: the same one-row prompt sampled ``--calls`` times directly with ``generate``
   and through the endpoint (one session, a fresh conversation per call, so the same
   work); the difference per call is the endpoint's (HTTP, JSON, template, bookkeeping).
2. sessions: ``S`` episodes at once, each a 4-call conversation with feedback (the
   guess-the-number agent), for growing ``S``; prints calls/s, rows per engine call and
   failures. The largest ``S`` without failures is what this machine sustains.

    python bench/openai_endpoint.py [--engine vllm] [--calls 50] [--sessions 16,64,256,1024,2048]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from openai import AsyncOpenAI, OpenAI  # noqa: E402

from rlframe.agent_server.app import AgentServer  # noqa: E402
from rlframe.agent_server.trajectory import Episode  # noqa: E402
from rlframe.config import (  # noqa: E402
    ActorConfig,
    AgentConfig,
    Config,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    RolloutEngineName,
)
from rlframe.data.tiny_model import resolve_model_path  # noqa: E402
from rlframe.rollout.rows import build_request  # noqa: E402

PROMPT = "guess0-9:"
TURN_TOKENS = 4


def build(engine: str) -> tuple[Config, Any, Any, str]:
    from transformers import AutoTokenizer

    from workers.roles.rollout_role import RolloutRole

    # What a worker process of a pool of one has (vLLM's executor reads them).
    for key, value in (("OMP_NUM_THREADS", "2"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                       ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29517")):  # fmt: skip
        os.environ.setdefault(key, value)
    cfg = Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(task="guess", batch_size=16, max_prompt_length=64),
        rollout=RolloutConfig(
            engine=RolloutEngineName(engine),
            agent="openai",
            n=16,
            max_tokens=16,
            cpu_kv_cache_gb=1,
        ),  # fmt: skip
        agent=AgentConfig(max_turns=4, max_obs_tokens=16, max_pending_requests=4096),
        actor=ActorConfig(mini_batch_size=256, micro_batch_size=128),
    )
    path = resolve_model_path("tiny:0")
    tokenizer = AutoTokenizer.from_pretrained(path)
    return cfg, RolloutRole(cfg, path, "cpu", 0), tokenizer, path


def direct_call(role: Any, tokenizer: Any, ids: list[int], seed: int) -> None:
    meta = {"stop_token_ids": [tokenizer.eos_token_id], "pad_token_id": tokenizer.pad_token_id}
    role.generate(build_request([ids], [seed], [TURN_TOKENS], meta))


def measure_overhead(server: AgentServer, role: Any, tokenizer: Any, calls: int) -> None:
    ids = list(tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    client = OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": PROMPT}]

    def endpoint_call(seed: int) -> None:
        # A session per call: an episode keeps at most agent.max_rows_per_episode rows, and
        # each fresh conversation is a row of its own.
        session = open_session(server, tokenizer, seed)
        client.with_options(api_key=session.key).chat.completions.create(
            model="m", messages=messages, max_tokens=TURN_TOKENS
        )
        server.sessions.close(session.key)

    for _ in range(5):  # warm both paths
        direct_call(role, tokenizer, ids, 0)
        endpoint_call(0)
    direct, endpoint = [], []
    for i in range(calls):
        start = time.perf_counter()
        direct_call(role, tokenizer, ids, i)
        direct.append(time.perf_counter() - start)
        start = time.perf_counter()
        endpoint_call(i)
        endpoint.append(time.perf_counter() - start)
    d, e = statistics.median(direct) * 1e3, statistics.median(endpoint) * 1e3
    print(
        f"overhead: {calls} calls of {TURN_TOKENS} tokens, median direct generate {d:.2f} ms, "
        f"through the endpoint {e:.2f} ms: +{e - d:.2f} ms per call"
    )


def open_session(server: AgentServer, tokenizer: Any, seed: int) -> Any:
    episode = Episode(tokenizer, {int(tokenizer.eos_token_id)})
    return server.sessions.open({"prompt": PROMPT, "ground_truth": "5"}, seed, episode)


async def episode(client: AsyncOpenAI, key: str) -> int:
    messages: list[Any] = [{"role": "user", "content": PROMPT}]
    session = client.with_options(api_key=key)
    for _ in range(4):
        reply = await session.chat.completions.create(model="m", messages=messages, max_tokens=1)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": " higher:"},
        ]
    return 4


async def run_sessions(server: AgentServer, tokenizer: Any, count: int) -> tuple[int, int, float]:
    keys = [open_session(server, tokenizer, i).key for i in range(count)]
    async with AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(episode(client, k) for k in keys), return_exceptions=True)
        seconds = time.perf_counter() - start
    for k in keys:
        server.sessions.close(k)
    failures = sum(isinstance(r, BaseException) for r in results)
    return sum(r for r in results if isinstance(r, int)), failures, seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--sessions", default="16,64,256,1024,2048")
    args = parser.parse_args()
    cfg, role, tokenizer, path = build(args.engine)
    server = AgentServer(cfg, role.generate, tokenizer, "tiny")
    server.batcher.meta = {
        "stop_token_ids": [tokenizer.eos_token_id],
        "pad_token_id": tokenizer.pad_token_id,
    }
    server.start()
    print(f"engine {args.engine}, tiny model, {os.cpu_count()} cores")
    measure_overhead(server, role, tokenizer, args.calls)
    for count in (int(s) for s in args.sessions.split(",")):
        calls_before, rows_before = server.batcher.calls, server.batcher.rows
        calls, failures, seconds = asyncio.run(run_sessions(server, tokenizer, count))
        engine_calls = server.batcher.calls - calls_before
        rows = server.batcher.rows - rows_before
        print(
            f"sessions {count:4d}: {calls} calls in {seconds:.2f} s ({calls / seconds:.0f} "
            f"calls/s), {rows / max(engine_calls, 1):.1f} rows per engine call, "
            f"{failures} failed episodes"
        )
    server.stop()


if __name__ == "__main__":
    main()
