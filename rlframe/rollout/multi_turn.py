"""Multi-turn episodes: the model and an environment take turns, token in, token out.

Each episode is a coroutine: it sends its whole context (prompt + response so far) to the
engines as one request of the stream (:mod:`rlframe.rollout.turns`), with what is left of its
sampled-token budget as ``max_tokens``, waits for that turn alone, steps its env, and goes on;
no episode waits for another's turn or env call, and all of an episode's turns go to one
engine replica (its prefix stays cached there). The next context is the previous one + the
sampled ids + the observation's ids from the chat template
(:class:`rlframe.envs.chat.ChatFormat`): nothing the model sampled is ever re-tokenised.

An episode ends when the env says done, after ``agent.max_turns`` turns, when the budget
(``rollout.max_tokens`` sampled tokens) is spent, or when a turn stops without its
end-of-turn token (cut by ``agent.max_tokens_per_turn``; with ``agent.close_cut_turns`` the
end-of-turn token is appended with loss mask 0 and the episode goes on). Every turn's text
goes to ``env.step`` (the env may score a last answer); the observation that follows the
last turn is dropped, so a response always ends with the model's own tokens.

Layout of a response: ``[turn 1 | obs 1 | turn 2 | ... | turn k | padding]``; ``loss_mask``
is 1 on turn tokens only, ``response_mask`` on turns and observations.

Images (a vision-language model): the opening messages carry the prompt row's images
(``sample["images"]``) and an observation may carry more (image parts, see
:mod:`rlframe.envs.chat`); the row's ``images`` extra lists them all in the order their
expanded pads appear (the row's typed ``images``), so every engine call and the trainer's
forward get them with the ids.
A turn that sampled the image pad ends an episode with images: that pad stands for no image,
and the engine could not serve a context holding it beside real ones.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from rlframe.controller.reads import IMAGES
from rlframe.core.protocol import Batch
from rlframe.envs import ChatFormat, EnvError, build_env_factory, get_tools
from rlframe.envs.base import as_step_result, check_messages
from rlframe.envs.chat import read_images
from rlframe.envs.runner import CallOutcome, check_stuck_calls, run_one
from rlframe.rollout.agents import AGENTS, AgentContext
from rlframe.rollout.rows import AgentStats, TokenRow, add_turn_result, read_prompt_rows
from rlframe.rollout.turns import TurnRequest, sample_turn


def mix_seed(seed: int, turn: int) -> int:
    """Turn 0 keeps the row's seed (a one-turn episode samples what single_turn would);
    later turns get their own stream."""
    return seed if turn == 0 else hash((seed, turn)) & 0x7FFFFFFF


def build_samples(prompts: Batch) -> list[dict[str, Any]]:
    """What ``env.reset`` gets: the prompt row's text, chat turns, ground truth, images (a row
    of a vision-language prompt set) and columns."""
    messages = prompts.column("messages") if "messages" in prompts else [None] * len(prompts)
    images = prompts.column(IMAGES) if IMAGES in prompts else [None] * len(prompts)
    return [
        {**extra, "prompt": p, "messages": m, "ground_truth": gt}
        | ({"images": list(row_images)} if row_images else {})
        for p, m, gt, extra, row_images in zip(
            prompts.column("prompt"),
            messages,
            prompts.column("ground_truth"),
            prompts.column("extra"),
            images,
        )
    ]


EPISODES = itertools.count()
"""Numbers the episodes of this process: an episode's number names its stream session."""


class EpisodeRunner:
    """Runs the episodes of one batch of prompts; see the module docstring."""

    def __init__(self, prompts: Batch, ctx: AgentContext) -> None:
        self.prompts, self.ctx = prompts, ctx
        self.cfg = ctx.config
        self.agent = ctx.config.agent
        self.env_name = self.agent.env
        self.stop_ids = tuple(int(t) for t in prompts.meta["stop_token_ids"])
        meta = prompts.meta
        self.temperature = 0.0 if meta.get("greedy") else meta.get("temperature")
        """Greedy for ReMax's baseline, validation's own temperature, else the run's."""
        self.samples = build_samples(prompts)
        self.envs: list[Any] = []

    def run(self) -> list[TokenRow]:
        make_env = build_env_factory(self.env_name, self.agent.env_kwargs)
        self.envs = [make_env() for _ in range(len(self.prompts))]
        self.chat = ChatFormat(self.ctx.tokenizer, tools=get_tools(self.envs[0]))
        self.end_of_turn_id = int(self.ctx.tokenizer.convert_tokens_to_ids(self.chat.end_of_turn))
        self.ctx.turns.open()
        rows = asyncio.run(self.run_all())
        check_stuck_calls(self.agent.max_stuck_calls, self.agent.step_timeout_s, self.env_name)
        return [self.finish(t) for t in rows]

    async def run_all(self) -> list[TokenRow]:
        """Every episode at once; the first that raises cancels the others and is raised."""
        self.gate = asyncio.Semaphore(self.agent.max_concurrent_envs)
        try:
            async with asyncio.TaskGroup() as episodes:
                tasks = [episodes.create_task(self.run_episode(i)) for i in range(len(self.envs))]
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        return [t.result() for t in tasks]

    async def run_episode(self, i: int) -> TokenRow:
        """One episode: reset, then turn and env step until it ends."""
        session = f"episode-{next(EPISODES)}"
        opening = await self.call_env(self.envs[i].reset, (self.samples[i],), "reset", i)
        row, done = self.start(i, opening)
        try:
            for turn in range(self.agent.max_turns):
                if done:
                    break
                await self.sample_turn(row, turn, session)
                done = await self.step_env(row, i, turn)
        finally:
            self.ctx.turns.end_session(session)
        return row

    # -- one turn ------------------------------------------------------------------------

    def start(self, i: int, outcome: CallOutcome) -> tuple[TokenRow, bool]:
        """The episode's row, and whether it is over already (its reset failed)."""
        stats = AgentStats(agent_obs_images=0.0)
        if outcome.error is not None:
            # on_env_error=mask / fail_episode: nothing to sample from; keep the loader's
            # prompt. The reward stage masks the episode or scores it 0.
            row = read_prompt_rows(self.prompts.rows([i]))[0]
            row.source, row.finish_reason, row.agent = i, "env_error", stats
            stats.env_failed = 1.0
            return row, True
        messages = check_messages(outcome.value, self.env_name, "reset")
        ids = self.chat.prompt_ids(messages)
        limit = self.cfg.data.max_prompt_length
        if len(ids) > limit:
            raise EnvError(
                f"env {self.env_name}: the prompt of sample {i} ({self.describe(i)}) is "
                f"{len(ids)} tokens with the env's opening messages and tools, more than "
                f"data.max_prompt_length={limit}"
            )
        seed = int(self.prompts.column("seed")[i])
        row = TokenRow(ids, seed=seed, source=i, images=read_images(messages), agent=stats)
        return row, False

    async def sample_turn(self, row: TokenRow, turn: int, session: str) -> None:
        """The episode's next turn, from the stream."""
        budget = self.cfg.rollout.max_tokens
        per_turn = self.agent.max_tokens_per_turn or budget
        request = TurnRequest(
            row.context,
            mix_seed(row.seed, turn),
            min(per_turn, budget - row.sampled),
            self.stop_ids,
            self.temperature,
            tuple(row.images),
        )
        result = await sample_turn(self.ctx.turns, request, session)
        add_turn_result(row, result)

    async def step_env(self, t: TokenRow, i: int, turn: int) -> bool:
        """The env sees the turn's text; the episode goes on with the observation. Returns
        whether the episode ended."""
        outcome = await self.call_env(self.envs[i].step, (self.decode_turn(t),), "step", i, turn)
        budget = self.cfg.rollout.max_tokens
        stats = t.agent
        assert stats is not None  # set by start
        if outcome.error is not None:
            stats.env_failed = 1.0
            return True
        result = as_step_result(outcome.value, self.env_name)
        stats.env_reward += result.reward
        stats.agent_tool_calls += int(result.info.get("tool_calls", 0))
        stats.agent_tool_errors += int(result.info.get("tool_errors", 0))
        cut_off = t.finish_reason == "length"
        images = read_images(result.observation) if not result.done else []
        if (
            result.done
            or (cut_off and not self.agent.close_cut_turns)
            or t.turns >= self.agent.max_turns
            or t.sampled >= budget
            or self.sampled_image_pad(t, images)
        ):
            return True
        # A cut turn is closed as the template closes a turn; the policy did not sample it.
        close = [self.end_of_turn_id] if cut_off else []
        obs, was_cut = self.chat.observation_ids(
            result.observation, self.agent.max_obs_tokens - len(close)
        )
        t.add_observation(close + obs)
        stats.agent_obs_cut += was_cut
        if images:
            t.images.extend(images)
            stats.agent_obs_images = (stats.agent_obs_images or 0.0) + len(images)
        return False

    def sampled_image_pad(self, t: TokenRow, new_images: list[bytes]) -> bool:
        """Whether the row, which holds or would get images, has a sampled image pad."""
        if not (t.images or new_images):
            return False
        pad = self.chat.image_token_id()
        return any(m and token == pad for token, m in zip(t.response_ids, t.loss_mask))

    def decode_turn(self, t: TokenRow) -> str:
        """The turn's text without its end-of-turn token; special tokens stay visible."""
        n = next((k for k, m in enumerate(reversed(t.loss_mask)) if not m), len(t.loss_mask))
        ids = t.response_ids[len(t.response_ids) - n :]
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.ctx.tokenizer.decode(ids, skip_special_tokens=False)

    async def call_env(
        self, fn: Any, args: tuple[Any, ...], method: str, row: int, turn: int = -1
    ) -> CallOutcome:
        """One env call under ``agent.step_timeout_s``, at most ``agent.max_concurrent_envs``
        at once; a failure raises unless ``agent.on_env_error`` keeps the run going."""
        outcome = await run_one(fn, args, self.agent.step_timeout_s, self.gate)
        if outcome.error is not None and self.agent.on_env_error == "raise":
            where = f" at turn {turn + 1}" if turn >= 0 else ""
            raise EnvError(
                f"env {self.env_name} {method} failed on sample {row}{where} "
                f"({self.describe(row)}): {outcome.error}. Set "
                "agent.on_env_error=mask to leave such episodes out of training "
                "and go on."
            )
        return outcome

    def describe(self, row: int) -> str:
        prompt, truth = (
            str(self.prompts.column("prompt")[row])[-120:],
            str(self.prompts.column("ground_truth")[row]),
        )
        return f"prompt {prompt!r}, ground truth {truth!r}"

    # -- the rows ------------------------------------------------------------------------

    def finish(self, t: TokenRow) -> TokenRow:
        """The episode's row with its last counters and its prompt's text."""
        stats = t.agent
        assert stats is not None  # set by start
        stats.env_reward *= 1 - stats.env_failed
        stats.agent_turns = float(t.turns)
        stats.agent_obs_tokens = float(len(t.response_ids) - t.sampled)
        t.prompt = self.ctx.tokenizer.decode(t.prompt_ids, skip_special_tokens=False)
        return t


@AGENTS.register("multi_turn")
def run_episodes(prompts: Batch, ctx: AgentContext) -> list[TokenRow]:
    """The ``multi_turn`` agent: one episode per prompt row against ``agent.env``."""
    return EpisodeRunner(prompts, ctx).run()
