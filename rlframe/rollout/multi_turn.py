"""Multi-turn episodes: the model and an environment take turns, token in, token out.

Per turn, every live trajectory's whole context (prompt + response so far) goes to the
engine in ONE ``generate`` call, each row with what is left of its sampled-token budget as
``max_tokens``; then the env steps of the turn run concurrently. The next context is the
previous one + the sampled ids + the observation's ids from the chat template
(:class:`rlframe.envs.chat.ChatFormat`): nothing the model sampled is ever re-tokenised.

An episode ends when the env says done, after ``agent.max_turns`` turns, when the budget
(``rollout.max_tokens`` sampled tokens) is spent, or when a turn stops without its
end-of-turn token (cut by ``agent.max_tokens_per_turn``; with ``agent.close_cut_turns`` the
end-of-turn token is appended with loss mask 0 and the episode goes on). Every turn's text
goes to ``env.step`` (the env may score a last answer); the observation that follows the
last turn is dropped, so a response always ends with the model's own tokens.

Layout of a response: ``[turn 1 | obs 1 | turn 2 | ... | turn k | padding]``; ``loss_mask``
is 1 on turn tokens only, ``response_mask`` on turns and observations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rlframe.config.agent import compute_response_width
from rlframe.envs import ChatFormat, EnvError, build_env_factory, get_tools
from rlframe.envs.base import as_step_result, check_messages
from rlframe.envs.runner import CallOutcome, run_env_calls
from rlframe.protocol import Batch
from rlframe.rollout.agents import AGENTS, AgentContext


@dataclass
class Trajectory:
    """One episode in progress."""

    row: int
    env: Any
    prompt_ids: list[int]
    response: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Weights version of each response token: a turn's tokens that of the engine that sampled
    them (weights may change between turns under ``rollout.max_staleness >= 1``), an
    observation's that of the turn before it."""
    sampled: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    obs_tokens: int = 0
    obs_cut: int = 0
    env_reward: float = 0.0
    failed: bool = False
    done: bool = False
    finish_reason: str = "stop"

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response

    def add_turn(
        self, ids: list[int], logprobs: list[float], finish_reason: str, version: int
    ) -> None:
        self.response += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += [version] * len(ids)
        self.sampled += len(ids)
        self.turns += 1
        self.finish_reason = finish_reason

    def add_observation(self, ids: list[int]) -> None:
        self.response += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += self.versions[-1:] * len(ids)
        self.obs_tokens += len(ids)


def mix_seed(seed: int, turn: int) -> int:
    """Turn 0 keeps the row's seed (a one-turn episode samples what single_turn would);
    later turns get their own stream."""
    return seed if turn == 0 else hash((seed, turn)) & 0x7FFFFFFF


def build_samples(prompts: Batch) -> list[dict[str, Any]]:
    """What ``env.reset`` gets: the prompt row's text, chat turns, ground truth and columns."""
    messages = prompts["messages"] if "messages" in prompts else [None] * len(prompts)
    return [
        {**extra, "prompt": p, "messages": m, "ground_truth": gt}
        for p, m, gt, extra in zip(
            prompts["prompt"], messages, prompts["ground_truth"], prompts["extra"]
        )
    ]


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids, mask


class EpisodeRunner:
    """Runs the episodes of one batch of prompts; see the module docstring."""

    def __init__(self, prompts: Batch, ctx: AgentContext) -> None:
        self.prompts, self.ctx = prompts, ctx
        self.cfg = ctx.config
        self.agent = ctx.config.agent
        self.env_name = self.agent.env
        self.pad_id = int(prompts.meta["pad_token_id"])
        self.stop_ids = set(int(t) for t in prompts.meta["stop_token_ids"])
        self.samples = build_samples(prompts)
        self.weights_version = 0

    def run(self) -> Batch:
        make_env = build_env_factory(self.env_name, self.agent.env_kwargs)
        envs = [make_env() for _ in range(len(self.prompts))]
        resets = [(env.reset, (sample,)) for env, sample in zip(envs, self.samples)]
        opening = self.call_envs(resets, "reset", list(range(len(envs))))
        self.chat = ChatFormat(self.ctx.tokenizer, tools=get_tools(envs[0]))
        self.end_of_turn_id = int(self.ctx.tokenizer.convert_tokens_to_ids(self.chat.end_of_turn))
        trajectories = [
            self.start(i, env, outcome) for i, (env, outcome) in enumerate(zip(envs, opening))
        ]
        for turn in range(self.agent.max_turns):
            live = [t for t in trajectories if not t.done]
            if not live:
                break
            self.sample_turn(live, turn)
            self.step_envs(live, turn)
        return self.assemble(trajectories)

    # -- one turn ------------------------------------------------------------------------

    def start(self, row: int, env: Any, outcome: CallOutcome) -> Trajectory:
        if outcome.error is not None:
            # on_env_error=fail_episode: nothing to sample from; keep the loader's prompt.
            ids = self.prompts["prompt_ids"][row][self.prompts["prompt_mask"][row].bool()].tolist()
            return Trajectory(row, env, ids, failed=True, done=True, finish_reason="env_error")
        messages = check_messages(outcome.value, self.env_name, "reset")
        ids = self.chat.prompt_ids(messages)
        limit = self.cfg.data.max_prompt_length
        if len(ids) > limit:
            raise EnvError(
                f"env {self.env_name}: the prompt of sample {row} ({self.describe(row)}) is "
                f"{len(ids)} tokens with the env's opening messages and tools, more than "
                f"data.max_prompt_length={limit}"
            )
        return Trajectory(row, env, ids)

    def sample_turn(self, live: list[Trajectory], turn: int) -> None:
        """One generate call for every live trajectory."""
        budget = self.cfg.rollout.max_tokens
        per_turn = self.agent.max_tokens_per_turn or budget
        ids, mask = left_pad([t.context for t in live], self.pad_id)
        rows = [t.row for t in live]
        seeds = [mix_seed(int(self.prompts["seed"][r]), turn) for r in rows]
        max_tokens = torch.tensor([min(per_turn, budget - t.sampled) for t in live])
        meta = dict(self.prompts.meta) | {"more_turns": True}
        batch = Batch(
            {"prompt_ids": ids, "prompt_mask": mask, "max_tokens": max_tokens},
            {"seed": seeds},
            meta,
        )
        out = self.ctx.generate(batch)
        self.weights_version = int(out.meta.get("weights_version", self.weights_version))
        versions = (
            out["weights_version"].tolist()
            if "weights_version" in out
            else [self.weights_version] * len(live)
        )
        for i, t in enumerate(live):
            n = int(out["response_mask"][i].sum())
            ids, logprobs = (
                out["response_ids"][i, :n].tolist(),
                out["rollout_logprobs"][i, :n].tolist(),
            )
            t.add_turn(ids, logprobs, str(out["finish_reason"][i]), int(versions[i]))

    def step_envs(self, live: list[Trajectory], turn: int) -> None:
        """Every live env sees its turn's text; the episodes that go on get the observation."""
        actions = [self.decode_turn(t) for t in live]
        steps = [(t.env.step, (a,)) for t, a in zip(live, actions)]
        outcomes = self.call_envs(steps, "step", [t.row for t in live], turn)
        budget = self.cfg.rollout.max_tokens
        for t, outcome in zip(live, outcomes):
            if outcome.error is not None:
                t.failed, t.done = True, True
                continue
            result = as_step_result(outcome.value, self.env_name)
            t.env_reward += result.reward
            t.tool_calls += int(result.info.get("tool_calls", 0))
            t.tool_errors += int(result.info.get("tool_errors", 0))
            cut_off = t.finish_reason == "length"
            t.done = (
                result.done
                or (cut_off and not self.agent.close_cut_turns)
                or t.turns >= self.agent.max_turns
                or t.sampled >= budget
            )
            if not t.done:
                # A cut turn is closed as the template closes a turn; the policy did not sample it.
                close = [self.end_of_turn_id] if cut_off else []
                obs, was_cut = self.chat.observation_ids(
                    result.observation, self.agent.max_obs_tokens - len(close)
                )
                t.add_observation(close + obs)
                t.obs_cut += was_cut

    def decode_turn(self, t: Trajectory) -> str:
        """The turn's text without its end-of-turn token; special tokens stay visible."""
        ids = t.response[len(t.response) - self.last_turn_length(t) :]
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.ctx.tokenizer.decode(ids, skip_special_tokens=False)

    @staticmethod
    def last_turn_length(t: Trajectory) -> int:
        n = 0
        for m in reversed(t.loss_mask):
            if not m:
                break
            n += 1
        return n

    def call_envs(
        self, calls: list[tuple[Any, tuple[Any, ...]]], method: str, rows: list[int], turn: int = -1
    ) -> list[CallOutcome]:
        agent = self.agent
        outcomes = run_env_calls(
            calls, agent.step_timeout_s, agent.max_concurrent_envs, agent.max_stuck_calls
        )
        if self.agent.on_env_error == "raise":
            for row, outcome in zip(rows, outcomes):
                if outcome.error is not None:
                    where = f" at turn {turn + 1}" if turn >= 0 else ""
                    raise EnvError(
                        f"env {self.env_name} {method} failed on sample {row}{where} "
                        f"({self.describe(row)}): {outcome.error}. Set "
                        "agent.on_env_error=fail_episode to score such episodes 0 and go on."
                    )
        return outcomes

    def describe(self, row: int) -> str:
        prompt, truth = (
            str(self.prompts["prompt"][row])[-120:],
            str(self.prompts["ground_truth"][row]),
        )
        return f"prompt {prompt!r}, ground truth {truth!r}"

    # -- the batch -----------------------------------------------------------------------

    def assemble(self, trajectories: list[Trajectory]) -> Batch:
        width = compute_response_width(
            self.cfg.rollout.max_tokens, self.cfg.rollout.agent, self.agent
        )
        rows = len(trajectories)
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        response_mask, loss_mask, logprobs = (torch.zeros(rows, width) for _ in range(3))
        # Padding (and an episode with no turn) carries the row's first version.
        token_version = torch.full((rows, width), self.weights_version, dtype=torch.long)
        for i, t in enumerate(trajectories):
            n = len(t.response)
            if n > width:
                raise AssertionError(
                    f"response of {n} tokens exceeds the width {width}: the limits are inconsistent"
                )
            ids[i, :n] = torch.tensor(t.response, dtype=torch.long)
            response_mask[i, :n] = 1
            loss_mask[i, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
            logprobs[i, :n] = torch.tensor(t.logprobs)
            if t.versions:
                token_version[i] = t.versions[0]
                token_version[i, :n] = torch.tensor(t.versions, dtype=torch.long)
        prompt_ids, prompt_mask = left_pad([t.prompt_ids for t in trajectories], self.pad_id)

        def column(name: str) -> torch.Tensor:
            return torch.tensor([float(getattr(t, name)) for t in trajectories])

        tensors = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": ids,
            "response_mask": response_mask,
            "loss_mask": loss_mask,
            "rollout_logprobs": logprobs,
            "token_version": token_version,
            "weights_version": token_version.min(1).values,
            "env_reward": column("env_reward") * (1 - column("failed")),
            "env_failed": column("failed"),
            "agent_turns": column("turns"),
            "agent_tool_calls": column("tool_calls"),
            "agent_tool_errors": column("tool_errors"),
            "agent_obs_tokens": column("obs_tokens"),
            "agent_obs_cut": column("obs_cut"),
        }
        prompts_text = [
            self.ctx.tokenizer.decode(t.prompt_ids, skip_special_tokens=False) for t in trajectories
        ]
        columns = {"prompt": prompts_text, "finish_reason": [t.finish_reason for t in trajectories]}
        meta = dict(self.prompts.meta) | {"weights_version": self.weights_version}
        return Batch(self.prompts.tensors | tensors, self.prompts.columns | columns, meta)


@AGENTS.register("multi_turn")
def run_episodes(prompts: Batch, ctx: AgentContext) -> Batch:
    """The ``multi_turn`` agent: one episode per prompt row against ``agent.env``."""
    return EpisodeRunner(prompts, ctx).run()
