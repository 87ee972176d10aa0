"""``reward.on_error=mask`` and ``agent.on_env_error=mask``: a sample whose reward or env
failed leaves training instead of scoring 0. It is in no group statistic (mean, std,
leave-one-out baseline), no loss and no token count; a group it leaves short of samples is
replaced; ``reward/masked`` and ``agent/masked`` say how many. Numbers worked by hand."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from rlframe.algorithms.losses import LossScale, count_loss_scale
from rlframe.algorithms.policy_objective import PolicyTerms, compose_policy_loss
from rlframe.config import (
    ActorConfig,
    AgentConfig,
    AlgorithmConfig,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
)
from rlframe.core.protocol import SAMPLE_MASK, Batch
from rlframe.data.loader import PromptLoader
from rlframe.data.prompts import PromptRecord
from rlframe.data.tiny_model import build_tiny_tokenizer
from rlframe.envs import StepResult
from rlframe.loop.step_metrics import collect_step_metrics
from rlframe.loop.trainer import Trainer
from rlframe.loop.validation import compute_validation_metrics
from rlframe.observability.tracking import StageTimer
from rlframe.rewards import RewardError, RuleScorer
from rlframe.rewards.stage import RewardStage, find_rule_failures, mask_failed_samples
from rlframe.rollout import ExperienceProducer
from rlframe.rollout.rows import build_response
from rlframe.rollout.sampling import has_uniform_rewards
from tests.unit.cli_errors import check_config_error
from tests.unit.config_trees import build
from tests.unit.scripted_episodes import ScriptedPolicy, make_config, make_prompts, run

WIDTH = 3


def scored_batch(
    rewards: list[float], failed: list[bool], groups: list[int], **cfg: Any
) -> tuple[Batch, Config]:
    """Rows as the reward stage leaves them under ``reward.on_error=mask`` (``cfg``: the
    algorithm section): each with ``WIDTH`` loss tokens, the failed ones masked."""
    config = Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=len(set(groups))),
        rollout=RolloutConfig(n=len(rewards) // len(set(groups))),
        actor=ActorConfig(mini_batch_size=len(rewards), micro_batch_size=len(rewards)),
        algorithm=AlgorithmConfig(**cfg),
        reward=RewardConfig(on_error="mask", num_workers=0),
    )
    rows = len(rewards)
    batch = Batch(
        {
            "reward": torch.tensor(rewards),
            "score": torch.tensor(rewards),
            "reward_errors": torch.tensor(failed, dtype=torch.float32),
            "reward_timeouts": torch.zeros(rows),
            "loss_mask": torch.ones(rows, WIDTH, dtype=torch.long),
            "group": torch.tensor(groups),
        }
    )
    return mask_failed_samples(batch, config), config


def advantages_of(batch: Batch, cfg: Config) -> list[float]:
    """Per-row advantage (the value on every loss token; 0 for a row without any) as the
    trainer computes it: the estimator gets the rows' sample mask."""
    trainer = Trainer(cfg, None, None, None, lambda: 0, None)  # type: ignore[arg-type]
    out, _ = trainer.compute_advantages(batch)
    advantages = out.tensor("advantages")
    mask = out.tensor("loss_mask").bool()
    for row in range(len(out)):  # one value per response, on its loss tokens only
        assert (advantages[row][~mask[row]] == 0).all()
        assert torch.allclose(advantages[row][mask[row]], advantages[row][mask[row]][:1])
    return [float(a[0]) for a in advantages]


# -- the group statistics ------------------------------------------------------------------


def test_nemo_rl_case_a_masked_sample_leaves_the_group_mean() -> None:
    """Rewards [1, 1, 0, 0], the second masked: the other three are centred on their own
    mean 1/3, giving [2/3, -1/3, -1/3] (with the masked one in the mean it would be
    [0.5, -0.5, -0.5]); the masked sample has advantage 0 and no loss token."""
    batch, cfg = scored_batch([1, 1, 0, 0], [False, True, False, False], [0] * 4, norm_by_std=False)
    assert batch[SAMPLE_MASK].tolist() == [1, 0, 1, 1]
    assert batch["loss_mask"][1].sum() == 0 and batch["reward"][1] == 0
    assert advantages_of(batch, cfg) == pytest.approx([2 / 3, 0, -1 / 3, -1 / 3], abs=1e-6)


def test_std_normalised_grpo_uses_the_std_of_the_samples_that_count() -> None:
    """[1, x, 0, 0] with x masked: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) =
    sqrt(1/3); a second, unmasked group [0.5, 0.5, 1, 0] keeps its own numbers."""
    batch, cfg = scored_batch(
        [1, 1, 0, 0, 0.5, 0.5, 1, 0], [False, True] + [False] * 6, [0] * 4 + [1] * 4
    )
    s0 = math.sqrt(1 / 3)
    s1 = math.sqrt(0.5 / 3)  # deviations 0, 0, 0.5, -0.5
    expected = [2 / 3 / s0, 0, -1 / 3 / s0, -1 / 3 / s0, 0, 0, 0.5 / s1, -0.5 / s1]
    assert advantages_of(batch, cfg) == pytest.approx(expected, rel=1e-5)


def test_rloo_baseline_is_the_mean_of_the_other_samples_that_count() -> None:
    """[1, x, 0, 0] with x masked: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5 (with x in the
    others it would be 1 - 1/3 and 0 - 2/3)."""
    batch, cfg = scored_batch([1, 1, 0, 0], [False, True, False, False], [0] * 4, advantage="rloo")
    assert advantages_of(batch, cfg) == pytest.approx([1, 0, -0.5, -0.5], abs=1e-6)


def test_passk_counts_only_the_samples_that_count() -> None:
    """pass@2 over [1, x, 0, 0] with x masked: n = 3, one right. R = 1 - C(2,2)/C(3,2) = 2/3,
    s = sqrt(R (1 - R)); A+ = (1 - R)/s; a wrong one is in an all-wrong pair with
    probability C(1,1)/C(2,1) = 1/2: A- = (1 - R - 1/2)/s."""
    batch, cfg = scored_batch(
        [1, 1, 0, 0], [False, True, False, False], [0] * 4, advantage="grpo_passk", pass_k=2
    )
    r = 2 / 3
    s = math.sqrt(r * (1 - r))
    expected = [(1 - r) / s, 0, (1 - r - 0.5) / s, (1 - r - 0.5) / s]
    assert advantages_of(batch, cfg) == pytest.approx(expected, rel=1e-6)


def test_reinforce_pp_baseline_subtracts_the_mean_of_the_samples_that_count() -> None:
    """Group-mean baselines 1/3 for [1, x, 0, 0] with x masked (not 1/4) and 1/4 for
    [0, 0, 0, 1], then whitened over the batch's loss tokens (every row has 3)."""
    batch, cfg = scored_batch(
        [1, 1, 0, 0, 0, 0, 0, 1],
        [False, True] + [False] * 6,
        [0] * 4 + [1] * 4,
        advantage="reinforce_pp_baseline",
    )
    trainer = Trainer(cfg, None, None, None, lambda: 0, None)  # type: ignore[arg-type]
    out, _ = trainer.compute_advantages(batch)
    raw = torch.tensor([2 / 3, -1 / 3, -1 / 3, -0.25, -0.25, -0.25, 0.75])
    whitened = (raw - raw.mean()) / raw.std(unbiased=False)
    advantages = out.tensor("advantages")
    assert advantages[1].abs().sum() == 0
    assert advantages[[0, 2, 3, 4, 5, 6, 7]][:, 0] == pytest.approx(whitened.tolist(), rel=1e-4)


def test_dapo_reads_only_the_samples_that_count() -> None:
    """[x, 1, 1, 1] with x masked: the rewards that count are equal, so the group teaches
    nothing and DAPO drops it (the masked 0 must not make it look informative)."""
    group = Batch(
        {"reward": torch.tensor([0.0, 1, 1, 1]), SAMPLE_MASK: torch.tensor([0.0, 1, 1, 1])}
    )
    assert has_uniform_rewards(group)
    assert not has_uniform_rewards(group.with_tensors(**{SAMPLE_MASK: torch.ones(4)}))
    assert has_uniform_rewards(group.with_tensors(**{SAMPLE_MASK: torch.zeros(4)}))


# -- the loss ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_a_masked_sample_adds_nothing_to_the_loss_or_its_counts(mode: str) -> None:
    """The loss over four rows, one masked (loss mask 0), equals the loss over the other
    three alone, with the counts each would compute; the masked row gets no gradient."""
    torch.manual_seed(0)
    batch, cfg = scored_batch([1, 1, 0, 0], [False, True, False, False], [0] * 4, loss_agg=mode)
    batch = batch.with_tensors(
        loss_mask=batch.tensor("loss_mask")
        * torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    )
    trainer = Trainer(cfg, None, None, None, lambda: 0, None)  # type: ignore[arg-type]
    advantages = trainer.compute_advantages(batch)[0].tensor("advantages")
    mask = batch.tensor("loss_mask")
    logprobs = (-torch.rand(4, WIDTH)).requires_grad_()
    old = logprobs.detach() + 0.05 * torch.randn(4, WIDTH)

    def loss(rows: list[int]) -> torch.Tensor:
        terms = PolicyTerms(
            logprobs=logprobs[rows],
            entropy=torch.zeros(len(rows), WIDTH),
            advantages=advantages[rows],
            loss_mask=mask[rows],
            scale=count_loss_scale(mask[rows]),
            old_logprobs=old[rows],
        )
        return compose_policy_loss(terms, cfg.algorithm).loss

    assert count_loss_scale(mask) == LossScale(tokens=6, sequences=3)
    everything = loss([0, 1, 2, 3])
    assert everything.item() == pytest.approx(loss([0, 2, 3]).item(), rel=1e-6)
    everything.backward()
    assert logprobs.grad is not None and logprobs.grad[1].abs().sum() == 0
    assert logprobs.grad[0].abs().sum() > 0


# -- the producer: short groups replaced, rates reported ------------------------------------

TOKENIZER = build_tiny_tokenizer()
FAILS = {0: 3, 1: 2, 2: 0, 3: 4}
"""Prompt ``i+1=``: how many of its 4 rows answer "9", which the reward cannot score, by
``i % 4``: 3 (one left: replaced), 2 (kept, two masked), 0, 4 (none left: replaced)."""
SCORED: list[str] = []
"""Every response the reward saw."""


def fail_on_nine(response: str, ground_truth: str, sample: dict) -> float:
    SCORED.append(response)
    if response == "9":
        raise RuntimeError("the judge timed out")
    return float(response)


def always_fail(response: str, ground_truth: str, sample: dict) -> float:
    raise RuntimeError("the sandbox is down")


def answer(prompts: Batch) -> Batch:
    """Row p of prompt ``i+1=``'s group answers "9" while p < FAILS[i % 4], then "1" and
    "0" in turn (so the rows that count differ)."""
    seen: dict[tuple[int, ...], int] = {}
    picks = []
    for context in prompts["prompt_tokens"]:
        key = tuple(context)
        p = seen[key] = seen.get(key, -1) + 1
        i = int(TOKENIZER.decode(list(context)).split("+")[0])
        picks.append("9" if p < FAILS[i % 4] else str((p + 1) % 2))
    ids = TOKENIZER.convert_tokens_to_ids(picks)
    return build_response([([t], [-1.0], "stop") for t in ids], 0)


def make_producer(
    reward: Callable[..., float],
    policy: Callable[[Batch], Batch] = answer,
    staleness: int = 0,
    **algorithm: Any,
) -> ExperienceProducer:
    cfg = Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=2, max_prompt_length=8),
        rollout=RolloutConfig(n=4, max_tokens=2, max_staleness=staleness),
        actor=ActorConfig(mini_batch_size=8, micro_batch_size=8),
        algorithm=AlgorithmConfig(**algorithm),
        reward=RewardConfig(
            fn=f"tests.unit.test_masked_samples:{reward.__name__}", num_workers=0, on_error="mask"
        ),
    )
    records = [
        PromptRecord(f"{i}+1=", TOKENIZER(f"{i}+1=")["input_ids"], str(i + 1), {})
        for i in range(16)
    ]
    loader = PromptLoader(records, 2, seed=0)
    return ExperienceProducer(cfg, policy, TOKENIZER, loader, RewardStage(cfg, TOKENIZER))


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_group_left_with_one_sample_is_replaced_and_the_rate_reported(dynamic: bool) -> None:
    """Half the prompts leave a group with 1 or 0 samples that count: each is replaced by
    another prompt, up to data.batch_size (2) a step; past that it is kept with every row
    masked. The step's reward/masked is over every sample scored, replaced groups' too."""
    producer = make_producer(fail_on_nine, dynamic_sampling=dynamic)
    dropped = kept = uniform = 0.0
    for _ in range(4):
        SCORED.clear()
        batch, metrics = producer.next_batch()
        assert len(batch) == 8
        kinds = [int(p.split("+")[0]) % 4 for p in batch.column("prompt")[::4]]
        whole = 0
        for kind, rows in zip(kinds, batch.split(4)):
            counted = rows.tensor(SAMPLE_MASK).tolist()
            if kind in (0, 3):  # short: only past the step's budget, every row masked
                assert counted == [0, 0, 0, 0]
                whole += 1
            else:
                assert counted == ([0, 0, 1, 1] if kind == 1 else [1, 1, 1, 1])
                assert rows.tensor("reward_errors").tolist() == [1 - c for c in counted]
            masked = rows.tensor(SAMPLE_MASK) == 0
            assert rows.tensor("loss_mask")[masked].sum() == 0
            assert rows.tensor("loss_mask")[~masked].sum() == int((~masked).sum())
            assert (rows.tensor("reward")[masked] == 0).all()
        assert metrics["rollout/masked_groups_kept"] == whole
        assert metrics["reward/masked"] == pytest.approx(SCORED.count("9") / len(SCORED))
        assert metrics["rollout/masked_groups_dropped"] <= 2
        dropped += metrics["rollout/masked_groups_dropped"]
        uniform += metrics.get("rollout/uniform_dropped", 0)
        kept += whole
        # reward/mean is over the samples that count: no masked 0 pulls it down.
        step = collect_step_metrics(batch.with_tensors(**timing_columns(batch)), timer(), False)
        valid = batch.tensor(SAMPLE_MASK).bool()
        if valid.any():
            expected = float(batch.tensor("reward")[valid].mean())
            assert step["reward/mean"] == pytest.approx(expected)
    # The fourth step: 12+1 and 15+1 replaced, 7+1 kept masked whole; DAPO then replaces a
    # group in which no sample counts (its rewards are uniform), as another prompt.
    assert dropped == 2 and kept == (0 if dynamic else 1)
    # Every prompt drawn was trained on, replaced, or is still in flight.
    assert producer.groups_served == 8 + dropped + uniform + len(producer.groups)


def test_short_groups_are_replaced_when_generation_runs_ahead() -> None:
    """At max_staleness=1 groups are admitted a step ahead: a short group is still replaced
    by another prompt (or, past the budget, masked whole), and none reaches the trainer with
    fewer than 2 samples that count."""
    producer = make_producer(fail_on_nine, staleness=1)
    dropped = kept = whole = 0.0
    for _ in range(4):
        batch, metrics = producer.next_batch()
        assert len(batch) == 8
        for rows in batch.split(4):
            counted = int(rows.tensor(SAMPLE_MASK).sum())
            assert counted >= 2 or counted == 0
            whole += counted == 0
        dropped += metrics["rollout/masked_groups_dropped"]
        kept += metrics["rollout/masked_groups_kept"]
    assert dropped >= 2 and whole <= kept
    assert producer.groups_served == 8 + dropped + len(producer.groups)


def test_past_its_budget_a_short_group_is_kept_with_every_row_masked() -> None:
    """A reward that always fails: data.batch_size groups are replaced, the next ones kept,
    every row masked (no loss token left), and the step reports reward/masked 1."""
    producer = make_producer(always_fail)
    batch, metrics = producer.next_batch()
    assert metrics["rollout/masked_groups_dropped"] == 2
    assert metrics["rollout/masked_groups_kept"] == 2
    assert metrics["reward/masked"] == 1.0
    assert batch.tensor(SAMPLE_MASK).sum() == 0 and batch.tensor("loss_mask").sum() == 0
    assert count_loss_scale(batch.tensor("loss_mask")) == LossScale(tokens=0, sequences=0)


def timing_columns(batch: Batch) -> dict[str, torch.Tensor]:
    return {"prompt_mask": torch.ones(len(batch), 1)}


def timer() -> StageTimer:
    t = StageTimer()
    t.seconds["step"] = 1.0
    return t


def test_remax_group_whose_greedy_reward_failed_is_replaced() -> None:
    """ReMax's baseline is the greedy response's reward: when that one cannot be scored the
    group has nothing to compare with, and is replaced like a short group."""

    def greedy_fails_on_even(prompts: Batch) -> Batch:
        if not prompts.meta.get("greedy"):
            return answer_all_valid(prompts)
        even = [
            int(TOKENIZER.decode(list(c)).split("+")[0]) % 2 == 0 for c in prompts["prompt_tokens"]
        ]
        ids = TOKENIZER.convert_tokens_to_ids(["9" if e else "1" for e in even])
        return build_response([([t], [-1.0], "stop") for t in ids], 0)

    producer = make_producer(fail_on_nine, greedy_fails_on_even, advantage="remax")
    batch, metrics = producer.next_batch()
    # The loader's first prompts are 10+1= and 14+1=: both replaced (by 5+1= and 1+1=).
    assert metrics["rollout/masked_groups_dropped"] == 2
    assert list(batch.column("prompt")[::4]) == ["5+1=", "1+1="]
    assert batch.tensor(SAMPLE_MASK).tolist() == [1.0] * 8
    assert batch.tensor("baseline").tolist() == [1.0] * 8
    assert metrics["reward/masked"] == 0  # the training samples' own rewards all scored


def answer_all_valid(prompts: Batch) -> Batch:
    picks = [str(p % 2) for p in range(len(prompts))]
    ids = TOKENIZER.convert_tokens_to_ids(picks)
    return build_response([([t], [-1.0], "stop") for t in ids], 0)


# -- the config ------------------------------------------------------------------------------


def test_the_mask_choices_are_accepted() -> None:
    cfg = build(reward={"on_error": "mask", "retry_on_error": True}, agent={"on_env_error": "mask"})
    assert cfg.reward.on_error == "mask" and cfg.reward.retry_on_error
    assert cfg.agent.on_env_error == "mask"
    assert RewardConfig().on_error == "raise" and not RewardConfig().retry_on_error
    assert AgentConfig().on_env_error == "raise"
    with pytest.raises(ConfigError, match=r"^reward.on_error: must be one of \['raise', 'mask'"):
        RewardConfig(on_error="drop")
    with pytest.raises(ConfigError, match=r"^agent.on_env_error: must be one of \['raise', 'mask'"):
        AgentConfig(on_env_error="zero")


@pytest.mark.parametrize(
    "override,key,text",
    [
        ("reward.on_error=skip", "reward.on_error", "must be one of ['raise', 'mask', 'zero']"),
        (
            "agent.on_env_error=zero",
            "agent.on_env_error",
            "must be one of ['raise', 'mask', 'fail_episode']",
        ),
        ("reward.retry_on_error=maybe", "reward.retry_on_error", "is not a valid bool"),
    ],
)
def test_a_wrong_choice_stops_before_ray_naming_the_key(override: str, key: str, text: str) -> None:
    check_config_error("+recipe=grpo_tiny", override, key=key, text=text)


# -- one retry before the policy decides -----------------------------------------------------

TRANSIENT = '''
from pathlib import Path

def fails_once(response, ground_truth, sample):
    """Raises the first time it sees a sample (a marker file per prompt), then scores it;
    "always" always raises."""
    if response == "always":
        raise RuntimeError("down for good")
    marker = Path(sample["markers"]) / sample["prompt"]
    if not marker.exists():
        marker.touch()
        raise RuntimeError("preempted")
    return float(response)
'''


@pytest.mark.parametrize("workers", [0, 2])
def test_one_retry_scores_a_transient_failure(tmp_path: Path, workers: int) -> None:
    plugin = tmp_path / "transient.py"
    plugin.write_text(TRANSIENT)
    responses = ["1", "0.5", "always", "0"]

    def score(on_error: str, retry: bool) -> Any:
        markers = tmp_path / f"markers-{on_error}-{retry}"
        markers.mkdir()
        samples = [{"prompt": f"p{i}", "markers": str(markers)} for i in range(len(responses))]
        cfg = RewardConfig(num_workers=workers, on_error=on_error, retry_on_error=retry)
        scorer = RuleScorer(f"{plugin}:fails_once", cfg)
        try:
            return scorer.score(responses, ["x"] * len(responses), samples)
        finally:
            scorer.close()

    out = score("mask", retry=True)
    assert out.scores == [1.0, 0.5, 0.0, 0.0] and out.errors == [False, False, True, False]
    assert out.retried == [True] * 4
    out = score("zero", retry=False)
    assert out.errors == [True] * 4 and out.retried == [False] * 4
    # Under raise the retry comes first too: only the failure that stays stops the run.
    with pytest.raises(RewardError, match=r"raised RuntimeError: down for good .* on sample 2 "):
        score("raise", retry=True)


# -- multi-turn: an env that fails -------------------------------------------------------------


class CrashingEnv:
    """Scores the turn: 1 for "1", 0 for anything else, and crashes on a "2"."""

    def reset(self, sample: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": sample["prompt"]}]

    def step(self, action: str) -> StepResult:
        if "2" in action:
            raise RuntimeError("the sandbox was preempted")
        return StepResult([], float(action == "1"), True, {})


@pytest.mark.parametrize("policy", ["mask", "fail_episode"])
def test_an_episode_whose_env_failed_is_masked_not_scored_zero(policy: str) -> None:
    """Four episodes of one prompt's group end with env rewards 1, (crash), 0, 0. Under
    ``mask`` the crashed one leaves the group: Dr.GRPO advantages [2/3, 0, -1/3, -1/3] and
    ``agent/masked`` 1/4. Under ``fail_episode`` it is a wrong answer: [3/4, -1/4, -1/4, -1/4]."""
    prompts = ["a:", "b:", "c:", "d:"]
    scripted = ScriptedPolicy(prompts, [["1<eos>"], ["2<eos>"], ["0<eos>"], ["3<eos>"]], width=4)
    cfg = make_config(
        "tests.unit.test_masked_samples:CrashingEnv",
        4,
        max_tokens=4,
        max_turns=1,
        on_env_error=policy,
        rule_reward_weight=0.0,
    )
    cfg.reward.num_workers = 0
    cfg.algorithm.advantage, cfg.algorithm.norm_by_std = "grpo", False
    episodes = run(cfg, scripted, make_prompts(prompts, ["1"] * 4))
    episodes = episodes.with_tensors(group=torch.zeros(4, dtype=torch.long))  # one group
    assert episodes["env_failed"].tolist() == [0, 1, 0, 0]
    assert episodes["loss_mask"][1].sum() > 0  # the failed episode sampled a turn
    batch = RewardStage(cfg, build_tiny_tokenizer()).compute_rewards(episodes)
    if policy == "mask":
        assert batch[SAMPLE_MASK].tolist() == [1, 0, 1, 1]
        assert batch["loss_mask"][1].sum() == 0
        assert advantages_of(batch, cfg) == pytest.approx([2 / 3, 0, -1 / 3, -1 / 3], abs=1e-6)
    else:
        assert batch[SAMPLE_MASK].tolist() == [1, 1, 1, 1]
        assert batch["reward"].tolist() == [1, 0, 0, 0]
        assert advantages_of(batch, cfg) == pytest.approx([0.75, -0.25, -0.25, -0.25], abs=1e-6)


def crash_second_row(seed: int) -> Callable[[Batch], Batch]:
    """A policy whose episodes answer by their copy in the group (told by the row seed
    :func:`build_prompt_batch` gives it, whatever order they reach the engine in): each
    group's second row answers "2" (its env crashes), the others "1", "0", "0"."""
    copy_of = {hash((seed, g, c)) & 0x7FFFFFFF: c for g in range(2) for c in range(4)}

    def answer(prompts: Batch) -> Batch:
        turns = []
        for row_seed in prompts["seed"]:
            ids = TOKENIZER("1200"[copy_of[int(row_seed)]], add_special_tokens=False)["input_ids"]
            turns.append((ids + [TOKENIZER.eos_token_id], [-1.0] * (len(ids) + 1), "stop"))
        return build_response(turns, 0)

    return answer


def test_the_producer_reports_agent_masked() -> None:
    """A multi-turn step of 2 groups of 4, one env crash in each: the crashed episodes are
    masked, their groups kept (3 samples count), ``agent/masked`` is 2/8."""
    cfg = make_config(
        "tests.unit.test_masked_samples:CrashingEnv",
        2,
        max_tokens=4,
        max_turns=1,
        on_env_error="mask",
        rule_reward_weight=0.0,
    )
    cfg.rollout.n, cfg.reward.num_workers = 4, 0
    cfg.actor.mini_batch_size = cfg.actor.micro_batch_size = 8
    texts = ["a:", "b:"]
    records = [
        PromptRecord(t, TOKENIZER(t)["input_ids"], "1", {}, [{"role": "user", "content": t}])
        for t in texts
    ]
    producer = ExperienceProducer(
        cfg,
        crash_second_row(cfg.trainer.seed),
        TOKENIZER,
        PromptLoader(records, 2, seed=0),
        RewardStage(cfg, TOKENIZER),
    )
    batch, metrics = producer.next_batch()
    assert batch.tensor(SAMPLE_MASK).tolist() == [1, 0, 1, 1] * 2
    assert batch.tensor("env_reward").tolist() == [1, 0, 0, 0] * 2
    assert metrics["agent/masked"] == 0.25 and metrics["agent/env_failures"] == 2
    assert metrics["rollout/masked_groups_dropped"] == 0
    assert "reward/masked" not in metrics


def test_a_rule_failure_masks_only_rows_whose_reward_it_enters() -> None:
    """In an env's batch the rule score enters only with agent.rule_reward_weight > 0; an
    openai episode takes its last row's rule score, and only when the agent gave none."""
    failed = torch.tensor([0.0, 1.0, 1.0])
    openai = Batch(
        {
            "reward_errors": failed,
            "reward_timeouts": torch.zeros(3),
            "env_reward": torch.zeros(3),
            "agent_episode": torch.tensor([0, 0, 1]),
            "agent_reward_given": torch.tensor([0.0, 0.0, 1.0]),
        }
    )
    # Episode 0's reward is its last row's rule score, which failed: both rows; episode 1's
    # agent gave its reward, so its failed rule score is not in it.
    assert find_rule_failures(openai, AgentConfig()).tolist() == [True, True, False]
    multi_turn = Batch(
        {k: openai.tensor(k) for k in ("reward_errors", "reward_timeouts", "env_reward")}
    )
    assert find_rule_failures(multi_turn, AgentConfig()).tolist() == [False, True, True]
    alone = AgentConfig(rule_reward_weight=0.0)
    assert find_rule_failures(multi_turn, alone).tolist() == [False, False, False]


class Rollouts:
    """Keeps what the trainer logs to rollouts.jsonl."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def log_rollouts(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.rows += rows


def test_rollouts_log_says_which_samples_were_masked() -> None:
    batch, cfg = scored_batch([1, 1, 0, 0], [False, True, False, False], [0] * 4)
    batch = Batch(
        batch.tensors,
        {
            "prompt": ["p"] * 4,
            "response": ["1", "1", "0", "0"],
            "ground_truth": ["1"] * 4,
            "finish_reason": ["stop"] * 4,
        },
    )
    log = Rollouts()
    trainer = Trainer(cfg, None, None, None, lambda: 0, log)  # type: ignore[arg-type]
    trainer.log_rollouts(batch)
    assert [(r["masked"], r["reward"]) for r in log.rows] == [
        (False, 1.0),
        (True, 0.0),
        (False, 0.0),
        (False, 0.0),
    ]


# -- validation ------------------------------------------------------------------------------


def test_validation_leaves_masked_samples_out_of_its_means_and_pass_at_k() -> None:
    """Two prompts of 2 samples: [1, masked] and [0, 1]. Means over the three that count;
    pass@1 is the mean of 1/1 and 1/2; pass@2 only from the prompt with 2 that count."""
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    counted = torch.tensor([True, False, True, True])
    m = compute_validation_metrics(
        scores, scores, torch.tensor([2.0, 0.0, 4.0, 6.0]), 2, 1.0, counted=counted
    )
    assert m["val/reward/mean"] == pytest.approx(2 / 3)
    assert m["val/response_length/mean"] == pytest.approx(4.0)
    assert m["val/pass@1"] == pytest.approx((1 + 0.5) / 2)
    assert m["val/pass@2"] == pytest.approx(1.0)
    assert m["val/masked"] == pytest.approx(0.25)
