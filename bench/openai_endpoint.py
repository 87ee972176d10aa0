"""The ``openai`` agent's cost on the driver, per chat completion, split between the endpoint
and the agents' own ``openai`` client.

The engine answers at once (each request: one digit token, no model), so all that is left is
the driver's side of the ``openai`` agent: the agents (``recipes/agents/guess_openai.py``, the
real ``openai`` client), the OpenAI-compatible server (:mod:`rlframe.agent_server`) and the
request stream (:class:`~rlframe.rollout.engine_client.EngineClient`). A step is 256 episodes
of up to 4 calls, as in ``openai_agent_tiny``. Two placements of the agents:

- **in-process**: as a training run does (``run_env_calls`` on this process's event loop);
  this process's CPU seconds per call are the whole driver-side cost.
- **client process**: the same episodes from a child process; this process's CPU per call is
  the endpoint's own (server, stream), the child's is the client's (openai, httpx, asyncio).

CPU seconds (``getrusage``) rather than wall time: on a shared machine they move far less with
the load, which is printed beside them.

    python bench/openai_endpoint.py [--steps 3] [--episodes 256]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlframe.agent_server.agent import closing  # noqa: E402
from rlframe.agent_server.app import AgentServer  # noqa: E402
from rlframe.agent_server.trajectory import Episode  # noqa: E402
from rlframe.config import (  # noqa: E402
    ActorConfig,
    AgentConfig,
    Config,
    DataConfig,
    ModelConfig,
    RolloutConfig,
)
from rlframe.core.registry import load_function  # noqa: E402
from rlframe.data.tiny_model import resolve_model_path  # noqa: E402
from rlframe.envs.runner import run_env_calls  # noqa: E402
from rlframe.rollout.engine_client import EngineClient  # noqa: E402
from rlframe.rollout.turns import TurnRequest, TurnResult  # noqa: E402

ENTRY = "recipes/agents/guess_openai.py:play"
PROMPT = "guess0-9:"

CHILD = """
import asyncio, json, resource, sys
sys.path.insert(0, {repo!r})
from rlframe.core.registry import load_function
spec = json.loads(sys.stdin.read())
entry = load_function(spec["entry"])
async def main():
    calls = (entry(spec["base_url"], key, sample) for key, sample in spec["episodes"])
    return await asyncio.gather(*calls, return_exceptions=True)
start = resource.getrusage(resource.RUSAGE_SELF)
out = asyncio.run(main())
end = resource.getrusage(resource.RUSAGE_SELF)
cpu = end.ru_utime + end.ru_stime - start.ru_utime - start.ru_stime
print(json.dumps({{"cpu": cpu, "errors": sum(isinstance(o, BaseException) for o in out)}}))
"""


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


class InstantEngine:
    """A replica's ``serve`` that answers every request with one random digit at once."""

    def __init__(self, digits: list[int]) -> None:
        self.digits, self.rng, self.requests = digits, random.Random(0), 0

    def serve(self, requests: list[TurnRequest]) -> list[TurnResult]:
        self.requests += len(requests)
        return [
            TurnResult(r.request_id, [self.rng.choice(self.digits)], [-1.0], "length", 0)
            for r in requests
        ]


def build_config() -> Config:
    """``openai_agent_tiny``'s shape."""
    return Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(task="guess", batch_size=16, max_prompt_length=16),
        rollout=RolloutConfig(agent="openai", n=16, max_tokens=4, temperature=1.0),
        agent=AgentConfig(max_turns=4, max_obs_tokens=16, entry=ENTRY),
        actor=ActorConfig(mini_batch_size=256, micro_batch_size=128),
    )


def play_step(
    server: AgentServer, client: EngineClient, tokenizer: Any, episodes: int, in_process: bool
) -> tuple[float, float | None, int]:
    """One step's episodes: (this process's CPU s, the child's CPU s or None, failures)."""
    stop = {int(tokenizer.eos_token_id)}
    sessions = [
        server.sessions.open(
            {"prompt": PROMPT, "ground_truth": str(i % 10)},
            i,
            Episode(tokenizer, stop, server.formats),
        )
        for i in range(episodes)
    ]
    start = cpu_seconds()
    child_cpu = None
    if in_process:
        entry = load_function(ENTRY)
        calls = [
            (closing(entry, server, s.key), (server.base_url, s.key, s.sample)) for s in sessions
        ]
        failures = sum(o.error is not None for o in run_env_calls(calls, 300, 4096, 8))
    else:
        spec = {
            "entry": ENTRY,
            "base_url": server.base_url,
            "episodes": [(s.key, s.sample) for s in sessions],
        }
        child = subprocess.run(
            [sys.executable, "-c", CHILD.format(repo=str(REPO))],
            input=json.dumps(spec), capture_output=True, text=True, check=True, cwd=REPO,
        )  # fmt: skip
        report = json.loads(child.stdout.strip().splitlines()[-1])
        child_cpu, failures = float(report["cpu"]), int(report["errors"])
    own_cpu = cpu_seconds() - start
    for s in sessions:
        server.sessions.close(s.key)
        client.end_session(s.key)
    return own_cpu, child_cpu, failures


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--episodes", type=int, default=256)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny:0"))
    digits = [int(tokenizer.convert_tokens_to_ids(str(d))) for d in range(10)]
    engine = InstantEngine(digits)
    client = EngineClient([engine.serve])
    server = AgentServer(build_config(), client, tokenizer, "tiny")
    server.sample_like({"stop_token_ids": [tokenizer.eos_token_id]})
    server.start()
    print(f"{args.episodes} guess_openai episodes a step, instant engine, {os.cpu_count()} cores")
    try:
        for in_process in (True, False):
            where = "in-process" if in_process else "client process"
            for step in range(args.steps):
                before, wall = engine.requests, time.perf_counter()
                own, child, failures = play_step(
                    server, client, tokenizer, args.episodes, in_process
                )
                wall = time.perf_counter() - wall
                n = max(engine.requests - before, 1)
                split = (
                    f"driver {own / n * 1e3:.2f} ms"
                    if child is None
                    else f"endpoint {own / n * 1e3:.2f} ms + client {child / n * 1e3:.2f} ms"
                )
                print(
                    f"{where} step {step + 1}: {n} calls in {wall:.2f} s; CPU per call: "
                    f"{split}; {failures} failed episodes; load {load_average()}",
                    flush=True,
                )
    finally:
        server.stop()
        client.close()


if __name__ == "__main__":
    main()
