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

Images (a vision-language model): the opening messages carry the prompt row's images
(``sample["images"]``) and an observation may carry more (image parts, see
:mod:`rlframe.envs.chat`); the row's ``images`` extra lists them all in the order their
expanded pads appear, so every engine call and the trainer's forward get them with the ids.
A turn that sampled the image pad ends an episode with images: that pad stands for no image,
and the engine could not serve a context holding it beside real ones.
"""

from __future__ import annotations

from typing import Any

from rlframe.config.agent import compute_response_width
from rlframe.controller.reads import IMAGES
from rlframe.core.protocol import Batch
from rlframe.envs import ChatFormat, EnvError, build_env_factory, get_tools
from rlframe.envs.base import as_step_result, check_messages
from rlframe.envs.chat import read_images
from rlframe.envs.runner import CallOutcome, run_env_calls
from rlframe.rollout.agents import AGENTS, AgentContext
from rlframe.rollout.rows import TokenRow, attach, collate, image_extras, sample_turns

STATS = (
    "env_reward",
    "env_failed",
    "agent_tool_calls",
    "agent_tool_errors",
    "agent_obs_cut",
    "agent_obs_images",
)
"""Per-episode counters, kept as row extras (``agent_turns`` and ``agent_obs_tokens`` are
read off the row at the end)."""


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
        """The newest version a call of this batch ran with."""
        self.envs: list[Any] = []
        self.done: set[int] = set()
        """Rows whose episode ended."""

    def run(self) -> Batch:
        make_env = build_env_factory(self.env_name, self.agent.env_kwargs)
        self.envs = [make_env() for _ in range(len(self.prompts))]
        resets = [(env.reset, (sample,)) for env, sample in zip(self.envs, self.samples)]
        opening = self.call_envs(resets, "reset", list(range(len(self.envs))))
        self.chat = ChatFormat(self.ctx.tokenizer, tools=get_tools(self.envs[0]))
        self.end_of_turn_id = int(self.ctx.tokenizer.convert_tokens_to_ids(self.chat.end_of_turn))
        rows = [self.start(i, outcome) for i, outcome in enumerate(opening)]
        for turn in range(self.agent.max_turns):
            live = [i for i in range(len(rows)) if i not in self.done]
            if not live:
                break
            self.sample_turn(rows, live, turn)
            self.step_envs(rows, live, turn)
        return self.assemble(rows)

    # -- one turn ------------------------------------------------------------------------

    def start(self, i: int, outcome: CallOutcome) -> TokenRow:
        stats = {name: 0.0 for name in STATS}
        seed = int(self.prompts.column("seed")[i])
        if outcome.error is not None:
            # on_env_error=mask / fail_episode: nothing to sample from; keep the loader's
            # prompt. The reward stage masks the episode or scores it 0.
            self.done.add(i)
            ids = self.prompts.tensor("prompt_ids")[i][
                self.prompts.tensor("prompt_mask")[i].bool()
            ].tolist()
            stats["env_failed"] = 1.0
            images = self.samples[i].get("images", [])
            return TokenRow(
                ids, seed=seed, finish_reason="env_error", row_extras=stats | self.carry(images)
            )
        messages = check_messages(outcome.value, self.env_name, "reset")
        ids = self.chat.prompt_ids(messages)
        limit = self.cfg.data.max_prompt_length
        if len(ids) > limit:
            raise EnvError(
                f"env {self.env_name}: the prompt of sample {i} ({self.describe(i)}) is "
                f"{len(ids)} tokens with the env's opening messages and tools, more than "
                f"data.max_prompt_length={limit}"
            )
        return TokenRow(ids, seed=seed, row_extras=stats | self.carry(read_images(messages)))

    def carry(self, images: list[bytes]) -> dict[str, list[bytes]]:
        """The ``images`` extra of a row: present on every row when the prompts have images
        (the grid's column then replaces the prompts' one), else only on a row with some."""
        return {IMAGES: list(images)} if IMAGES in self.prompts else image_extras(images)

    def sample_turn(self, rows: list[TokenRow], live: list[int], turn: int) -> None:
        """One generate call for every live episode."""
        budget = self.cfg.rollout.max_tokens
        per_turn = self.agent.max_tokens_per_turn or budget
        todo = [rows[i] for i in live]
        seeds = [mix_seed(r.seed, turn) for r in todo]
        caps = [min(per_turn, budget - r.sampled) for r in todo]
        meta = dict(self.prompts.meta) | {"more_turns": True}
        out = sample_turns(self.ctx.generate, todo, seeds, caps, meta)
        self.weights_version = int(out.tensor("weights_version").max())

    def step_envs(self, rows: list[TokenRow], live: list[int], turn: int) -> None:
        """Every live env sees its turn's text; the episodes that go on get the observation."""
        steps = [(self.envs[i].step, (self.decode_turn(rows[i]),)) for i in live]
        outcomes = self.call_envs(steps, "step", live, turn)
        budget = self.cfg.rollout.max_tokens
        for i, outcome in zip(live, outcomes):
            t, stats = rows[i], rows[i].row_extras
            if outcome.error is not None:
                stats["env_failed"] = 1.0
                self.done.add(i)
                continue
            result = as_step_result(outcome.value, self.env_name)
            stats["env_reward"] += result.reward
            stats["agent_tool_calls"] += int(result.info.get("tool_calls", 0))
            stats["agent_tool_errors"] += int(result.info.get("tool_errors", 0))
            cut_off = t.finish_reason == "length"
            images = read_images(result.observation) if not result.done else []
            if (
                result.done
                or (cut_off and not self.agent.close_cut_turns)
                or t.turns >= self.agent.max_turns
                or t.sampled >= budget
                or self.sampled_image_pad(t, images)
            ):
                self.done.add(i)
                continue
            # A cut turn is closed as the template closes a turn; the policy did not sample it.
            close = [self.end_of_turn_id] if cut_off else []
            obs, was_cut = self.chat.observation_ids(
                result.observation, self.agent.max_obs_tokens - len(close)
            )
            t.add_observation(close + obs)
            stats["agent_obs_cut"] += was_cut
            if images:
                t.row_extras.setdefault(IMAGES, []).extend(images)
                stats["agent_obs_images"] += len(images)

    def sampled_image_pad(self, t: TokenRow, new_images: list[bytes]) -> bool:
        """Whether the row, which holds or would get images, has a sampled image pad."""
        if not (t.row_extras.get(IMAGES) or new_images):
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
                        "agent.on_env_error=mask to leave such episodes out of training "
                        "and go on."
                    )
        return outcomes

    def describe(self, row: int) -> str:
        prompt, truth = (
            str(self.prompts.column("prompt")[row])[-120:],
            str(self.prompts.column("ground_truth")[row]),
        )
        return f"prompt {prompt!r}, ground truth {truth!r}"

    # -- the batch -----------------------------------------------------------------------

    def assemble(self, rows: list[TokenRow]) -> Batch:
        cfg = self.cfg
        for t in rows:
            stats = t.row_extras
            stats["env_reward"] *= 1 - stats["env_failed"]
            stats["agent_turns"] = float(t.turns)
            stats["agent_obs_tokens"] = float(len(t.response_ids) - t.sampled)
            stats["prompt"] = self.ctx.tokenizer.decode(t.prompt_ids, skip_special_tokens=False)
        width = compute_response_width(cfg.rollout.max_tokens, cfg.rollout.agent, self.agent)
        # A row no call ran (its env failed at reset) carries the latest version.
        grid = collate(rows, width, self.pad_id, self.weights_version)
        return attach(self.prompts, grid)


@AGENTS.register("multi_turn")
def run_episodes(prompts: Batch, ctx: AgentContext) -> Batch:
    """The ``multi_turn`` agent: one episode per prompt row against ``agent.env``."""
    return EpisodeRunner(prompts, ctx).run()
