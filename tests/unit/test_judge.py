"""The generative judge's scorers, failures and metrics, with hand-made verdicts: a scripted
judge engine (a ``serve`` of the request stream, behind the real :class:`EngineClient`)
answers each request from the text it was sent, so every expected number is worked by hand."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from rlframe.config import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
)
from rlframe.config.judge import JudgeConfig
from rlframe.config.served import MAX_TOP_K
from rlframe.config.served_models import list_served_models
from rlframe.core.protocol import SAMPLE_MASK, Batch
from rlframe.data.tiny_model import build_tiny_tokenizer
from rlframe.judges.client import JudgeClient, JudgedGroup, JudgeError, JudgeParseError
from rlframe.judges.scorers import parse_label, parse_number, parse_ranking
from rlframe.judges.stage import JudgeStage
from rlframe.rewards.stage import RewardStage
from rlframe.rollout.engine_client import EngineClient
from rlframe.rollout.turns import ScoredTokens, TurnRequest, TurnResult
from tests.unit.cli_errors import check_config_error
from tests.unit.test_masked_samples import advantages_of

TOKENIZER = build_tiny_tokenizer()
EOS = TOKENIZER.eos_token_id
TEMPLATE = "{prompt}{response}?"


def ids_of(text: str) -> list[int]:
    return list(TOKENIZER(text, add_special_tokens=False)["input_ids"])


Answer = Callable[[str, TurnRequest], "str | dict[str, float] | None"]
"""The scripted judge's answer to a request's text: a verdict (sampled request), the
next-token probabilities by token (scoring request), or None: never answered."""


class ScriptedJudge:
    """A judge engine replica that answers by ``answer``; requests answered None stay in
    flight for ever (a judge that hangs)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[TurnRequest] = []
        self.lock = threading.Lock()

    def serve(self, requests: list[TurnRequest]) -> list[TurnResult]:
        with self.lock:
            self.requests += requests
        done = []
        for r in requests:
            text = TOKENIZER.decode(r.context[: r.score_from], skip_special_tokens=True)
            got = self.answer(text, r)
            if got is None:
                continue
            if isinstance(got, str):
                out = ids_of(got) + [EOS]
                done.append(TurnResult(r.request_id, out, [0.0] * len(out), "stop", 0))
                continue
            top = sorted(got.items(), key=lambda kv: -kv[1])[: r.top_k]
            scored = ScoredTokens(
                [0.0],
                [[ids_of(t)[0] for t, _ in top]],
                [[math.log(p) for _, p in top]],
            )
            done.append(TurnResult(r.request_id, [], [], "stop", 0, scored=scored))
        if not done:
            time.sleep(0.01)  # the pump calls again at once while requests wait
        return done


def make_stage(answer: Answer, **judge: Any) -> tuple[JudgeStage, EngineClient, ScriptedJudge]:
    engine = ScriptedJudge(answer)
    client = EngineClient([engine.serve])
    cfg = JudgeConfig(path="tiny-judge:0", **({"template": TEMPLATE} | judge))
    return JudgeStage(JudgeClient(client, TOKENIZER, cfg, (EOS,))), client, engine


def make_batch(prompts: list[str], responses: list[str], groups: list[int]) -> Batch:
    """Rows as the producer hands them to the reward stage."""
    width = max(len(ids_of(r)) for r in responses) + 1
    ids = torch.full((len(responses), width), EOS)
    mask = torch.zeros(len(responses), width, dtype=torch.long)
    for i, r in enumerate(responses):
        row = ids_of(r) + [EOS]
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    return Batch(
        {
            "response_ids": ids,
            "response_mask": mask,
            "loss_mask": mask.clone(),
            "group": torch.tensor(groups),
        },
        {
            "prompt": prompts,
            "ground_truth": ["" for _ in prompts],
            "extra": [{} for _ in prompts],
            "messages": [[{"role": "user", "content": p}] for p in prompts],
        },
    )


def judge_batch(stage: JudgeStage, prompts: list[str], responses: list[str], groups: list[int]):
    return stage.start(make_batch(prompts, responses, groups), responses).result(timeout=30)


# -- the three ways to score -------------------------------------------------------------


def test_verdicts_are_parsed_into_scores_and_a_verdict_without_one_fails() -> None:
    """``verdict``: the judge writes "so 3 no 7" for "a" (last number: 7), "8" for "b", and
    "none" for "c" (no number: a parse failure, not a 0)."""
    verdicts = {"1+1=a?": "so 3 no 7", "1+1=b?": "8", "1+1=c?": "none"}
    stage, client, engine = make_stage(lambda text, r: verdicts[text], scorer="verdict")
    try:
        judged = judge_batch(stage, ["1+1="] * 3, ["a", "b", "c"], [0, 0, 0])
        assert judged.scores == [7.0, 8.0, 0.0]
        assert judged.failures == [None, None, "parse_failures"]
        assert all(r.score_from is None and r.temperature == 0.0 for r in engine.requests)
        metrics = stage.take_metrics()
        assert metrics["judge/calls"] == 3 and metrics["judge/parse_failures"] == 1
        # Tokens read and written: 6 of context each, verdicts of 9, 1 and 4 (+ EOS each).
        assert metrics["judge/tokens"] == 3 * 6 + (10 + 2 + 5)
        assert metrics["judge/score_mean"] == pytest.approx(7.5)
        assert metrics["judge/score_std"] == pytest.approx(0.5)
    finally:
        client.close()
        stage.close()


def test_parsers_read_the_last_number_and_the_last_label() -> None:
    assert parse_number("first 2, then -3.5", {}) == -3.5
    assert parse_label("not bad: yes", {"yes": 1.0, "no": 0.0}) == 1.0
    assert parse_label("yes at first, in the end no", {"yes": 1.0, "no": 0.0}) == 0.0
    with pytest.raises(JudgeParseError):
        parse_number("no digits", {})
    with pytest.raises(JudgeParseError):
        parse_label("maybe", {"yes": 1.0, "no": 0.0})


def test_expected_value_over_verdict_tokens_reads_the_next_token_distribution() -> None:
    """``expected`` with verdicts 1..9: p(7) = 0.5, p(9) = 0.25, p(x) = 0.25 (not a verdict)
    gives (0.5 * 7 + 0.25 * 9) / 0.75 = 23/3; a distribution with no verdict token among
    the top-k is a parse failure. One scoring request per response, nothing sampled."""
    answers = {
        "2+2=a?": {"7": 0.5, "9": 0.25, "x": 0.25},
        "2+2=b?": {"1": 0.1, "5": 0.9},
        "2+2=c?": {"x": 0.6, "z": 0.4},
    }
    stage, client, engine = make_stage(lambda text, r: answers[text], scorer="expected")
    try:
        judged = judge_batch(stage, ["2+2="] * 3, ["a", "b", "c"], [4, 4, 4])
        assert judged.scores[:2] == pytest.approx([23 / 3, 0.1 * 1 + 0.9 * 5])
        assert judged.failures == [None, None, "parse_failures"]
        for r in engine.requests:
            # The text, then one placeholder token whose top-k is the next-token distribution.
            assert r.score_from == len(r.context) - 1 and r.top_k == MAX_TOP_K
    finally:
        client.close()
        stage.close()


def test_listwise_ranks_a_group_in_one_call() -> None:
    """``listwise``: one call per group; "3, 1, 2" (best first) of 3 responses scores the
    third 1, the first 0.5, the second 0; a verdict that is not an order of 1..3 fails the
    whole group."""

    def answer(text: str, r: TurnRequest) -> str:
        return "ok\n3, 1, 2" if text.startswith("3+3=") else "1, 1, 2"

    template = "{prompt}{n}:{responses}"
    stage, client, engine = make_stage(answer, scorer="listwise", template=template)
    try:
        judged = judge_batch(stage, ["3+3="] * 3 + ["4+4="] * 3, list("abcdef"), [0] * 3 + [1] * 3)
        assert judged.scores == [0.5, 0.0, 1.0, 0.0, 0.0, 0.0]
        assert judged.failures == [None] * 3 + ["parse_failures"] * 3
        assert len(engine.requests) == 2
        assert "(1) a\n(2) b" in TOKENIZER.decode(engine.requests[0].context)
    finally:
        client.close()
        stage.close()
    assert parse_ranking("2,1", 2) == [0.0, 1.0]
    with pytest.raises(JudgeParseError):
        parse_ranking("1, 2", 3)


# -- failures: counted, masked or stopping the run -------------------------------------------


def judged_config(on_error: str) -> Config:
    return Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=1),
        rollout=RolloutConfig(n=4, max_tokens=2),
        actor=ActorConfig(mini_batch_size=4, micro_batch_size=4),
        algorithm=AlgorithmConfig(norm_by_std=False),
        reward=RewardConfig(
            weight=0.0,
            judge=JudgeConfig(
                path="tiny-judge:0",
                template=TEMPLATE,
                verdicts={"y": 1.0, "n": 0.0},
                timeout_s=0.3,
                on_error=on_error,
            ),
        ),
    )


def right_or_wrong(text: str, r: TurnRequest) -> dict[str, float] | None:
    """y for "a" and "b" (but "b" never comes back: the judge hangs on it), n otherwise."""
    if text.endswith("b?"):
        return None
    return {"y": 1.0} if text.endswith("a?") else {"n": 1.0}


def test_a_judge_that_times_out_under_mask_leaves_the_group_statistics() -> None:
    """The NeMo-RL case through the judge: rewards [1, 1, 0, 0], the second timed out under
    ``reward.judge.on_error=mask``: it is masked (no loss token, reward 0) and the other
    three are centred on their own mean 1/3: [2/3, -1/3, -1/3] (not [0.5, -0.5, -0.5])."""
    cfg = judged_config("mask")
    engine = ScriptedJudge(right_or_wrong)
    client = EngineClient([engine.serve])
    stage = JudgeStage(JudgeClient(client, TOKENIZER, cfg.reward.judge, (EOS,)))
    rewards = RewardStage(cfg, TOKENIZER, judge=stage)
    try:
        batch = rewards.compute_rewards(make_batch(["1+0="] * 4, ["a", "b", "c", "d"], [0] * 4))
        assert batch["judge_timeouts"].tolist() == [0, 1, 0, 0]
        assert batch[SAMPLE_MASK].tolist() == [1, 0, 1, 1]
        assert batch["loss_mask"][1].sum() == 0 and batch["reward"].tolist() == [1, 0, 0, 0]
        assert advantages_of(batch, cfg) == pytest.approx([2 / 3, 0, -1 / 3, -1 / 3], abs=1e-6)
        metrics = rewards.take_metrics()
        assert metrics["judge/timeouts"] == 1 and metrics["judge/calls"] == 4
        assert metrics["judge/score_mean"] == pytest.approx(1 / 3)
    finally:
        client.close()
        rewards.close()


def test_with_retry_a_sample_the_judge_timed_out_on_is_judged_again() -> None:
    """``reward.retry_on_error``: "b" hangs the first time only; its group is judged once more,
    "b" takes its second verdict (y: 1), nothing is masked, ``judge/retries`` is 1 and
    ``judge/timeouts`` (the failures that stand) 0."""
    seen: set[str] = set()

    def hangs_once(text: str, r: TurnRequest) -> dict[str, float] | None:
        if text.endswith("b?") and text not in seen:
            seen.add(text)
            return None
        return {"y": 1.0} if text.endswith(("a?", "b?")) else {"n": 1.0}

    cfg = judged_config("mask")
    engine = ScriptedJudge(hangs_once)
    client = EngineClient([engine.serve])
    stage = JudgeStage(JudgeClient(client, TOKENIZER, cfg.reward.judge, (EOS,)), retry=True)
    try:
        judged = judge_batch(stage, ["1+0="] * 4, ["a", "b", "c", "d"], [0] * 4)
        assert judged.scores == [1.0, 1.0, 0.0, 0.0] and judged.failures == [None] * 4
        metrics = stage.take_metrics()
        assert metrics["judge/retries"] == 1 and metrics["judge/timeouts"] == 0
        assert metrics["judge/calls"] == 8  # the whole group, twice
    finally:
        client.close()
        stage.close()


def test_a_judge_failure_under_raise_stops_the_run_with_one_line() -> None:
    cfg = judged_config("raise")
    engine = ScriptedJudge(right_or_wrong)
    client = EngineClient([engine.serve])
    stage = JudgeStage(JudgeClient(client, TOKENIZER, cfg.reward.judge, (EOS,)))
    rewards = RewardStage(cfg, TOKENIZER, judge=stage)
    try:
        with pytest.raises(JudgeError) as caught:
            rewards.compute_rewards(make_batch(["1+0="] * 4, ["a", "b", "c", "d"], [0] * 4))
        message = str(caught.value)
        assert "\n" not in message
        assert "sample 1 (timeout" in message and "reward.judge.on_error=mask" in message
    finally:
        client.close()
        rewards.close()


def test_a_scorer_that_raises_or_answers_a_non_number_fails_its_group(tmp_path: Any) -> None:
    """A user's scorer (``file.py:fn``): one group's call raises, the other returns NaN for
    its second response: those rows count as errors, the rest are scored."""
    plugin = tmp_path / "my_judge.py"
    plugin.write_text(
        "async def score(group, judge):\n"
        "    if group.prompt == 'bad':\n"
        "        raise RuntimeError('boom')\n"
        "    return [1.0, float('nan')]\n"
    )
    stage, client, _ = make_stage(lambda text, r: "1", scorer=f"{plugin}:score")
    try:
        judged = judge_batch(stage, ["bad", "bad", "ok", "ok"], list("abcd"), [0, 0, 1, 1])
        assert judged.failures == ["errors", "errors", None, "errors"]
        assert judged.scores == [0.0, 0.0, 1.0, 0.0]
        assert stage.take_metrics()["judge/errors"] == 3
    finally:
        client.close()
        stage.close()


# -- config ---------------------------------------------------------------------------------


def test_the_judge_is_a_served_model_and_its_keys_are_checked() -> None:
    cfg = judged_config("mask")
    [spec] = list_served_models(cfg)
    assert (spec.name, spec.key, spec.section) == ("judge", "reward.judge.path", "reward.judge")
    with pytest.raises(
        ConfigError, match=r"reward.judge.on_error: must be one of \['mask', 'raise'\]"
    ):
        JudgeConfig(path="x", on_error="zero")
    with pytest.raises(ConfigError, match="reward.judge.weight"):
        JudgeConfig(path="x", weight=0.0)
    with pytest.raises(ConfigError, match="reward.judge.verdicts: 'yes' is 3 tokens"):
        JudgeClient(EngineClient([]), TOKENIZER, JudgeConfig(verdicts={"yes": 1.0}), (EOS,))
    with pytest.raises(ConfigError, match="reward.judge.template: 'answer'"):
        JudgeStage(
            JudgeClient(EngineClient([]), TOKENIZER, JudgeConfig(template="{answer}"), (EOS,))
        )
    # With the rule reward off, the judge alone scores.
    assert RewardConfig(weight=0.0, judge=JudgeConfig(path="x")).uses_judge
    with pytest.raises(ConfigError, match="reward.weight"):
        RewardConfig(weight=0.0)


def test_a_judged_group_reaches_a_users_scorer_whole() -> None:
    """A user's scorer gets the prompt, every response of the group, the ground truth and the
    prompt's other columns, and may call the judge itself."""
    seen: list[JudgedGroup] = []

    async def scorer(group: JudgedGroup, judge: JudgeClient) -> list[float | BaseException]:
        seen.append(group)
        verdict = await judge.generate(judge.render("{prompt}", prompt=group.prompt))
        return [float(verdict)] * len(group.responses)

    from rlframe.judges.client import JUDGE_SCORERS

    JUDGE_SCORERS.entries["test_scorer"] = scorer
    try:
        stage, client, _ = make_stage(lambda text, r: "5", scorer="test_scorer")
        judged = judge_batch(stage, ["p", "p"], ["a", "b"], [9, 9])
        assert judged.scores == [5.0, 5.0]
        assert seen[0].responses == ["a", "b"] and seen[0].sample["messages"][0]["content"] == "p"
        client.close()
        stage.close()
    finally:
        del JUDGE_SCORERS.entries["test_scorer"]


def test_judge_recipes_compose_and_validate() -> None:
    """judge_tiny: the tiny judge alone scores, on a pool of its own; judge_qwen (GPU, not
    run): Qwen2.5-7B-Instruct on 2 GPUs of its own, tensor parallel 2, judging a 1.5B policy."""
    from tests.unit.test_config import compose

    tiny = compose("judge_tiny")
    assert tiny.reward.weight == 0 and not tiny.reward.uses_rule
    assert tiny.reward.judge.path == "tiny-judge:0" and tiny.reward.judge.scorer == "expected"
    assert [s.name for s in list_served_models(tiny)] == ["judge"]
    qwen = compose("judge_qwen")
    j = qwen.reward.judge
    assert (j.path, j.tensor_parallel_size, j.procs_per_node) == ("Qwen/Qwen2.5-7B-Instruct", 2, 2)
    assert qwen.model.path == "Qwen/Qwen2.5-1.5B-Instruct" and qwen.trainer.device.value == "cuda"
    colocated = compose("judge_tiny", "reward.judge.placement=colocated")
    assert [s.pool for s in list_served_models(colocated)] == [None]  # the trainer's bundles


@pytest.mark.parametrize(
    "override,key,text",
    [
        ("reward.judge.scorer=nope", "reward.judge.scorer", "unknown judge scorer 'nope'"),
        ("reward.judge.on_error=zero", "reward.judge.on_error", "must be one of ['mask', 'raise']"),
        ("reward.judge.placement=beside", "reward.judge.placement", "beside"),
        ("reward.judge.procs_per_node=0", "reward.judge.procs_per_node", "must be > 0"),
    ],
)
def test_a_judge_mistake_stops_before_ray_naming_the_key(
    override: str, key: str, text: str
) -> None:
    check_config_error("+recipe=judge_tiny", override, key=key, text=text)
