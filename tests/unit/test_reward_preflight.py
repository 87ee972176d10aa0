"""Reward keys fail before Ray starts, naming the key; what a run will score with is said."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlframe.config import Config, ConfigError, ModelConfig, RewardConfig, RewardModelConfig
from rlframe.data.tiny_model import resolve_model_path
from rlframe.run.preflight import check_reward_inputs
from tests.unit.cli_errors import check_config_error


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "reward.on_error=skip",
            "reward.on_error: must be one of ['raise', 'mask', 'zero'], got 'skip'",
        ),
        ("reward.num_workers=-2", "reward.num_workers: must be >= 0"),
        ("reward.timeout_s=0", "reward.timeout_s: must be > 0"),
        (
            "reward.weight=0",
            "reward.weight: is 0, which turns the rule reward off, and neither "
            "reward.model.path nor reward.judge.path is set",
        ),
        ("reward.model.path=/no/such/rm", "reward.model.path: no such folder /no/such/rm"),
        (
            "reward.model.path=tiny-rm:x",
            "reward.model.path: 'tiny-rm:x': use 'tiny-rm:<integer seed>'",
        ),
        (
            "reward.model.worker_cls=workers.reward_model.Nope",
            "reward.model.worker_cls: cannot be loaded",
        ),
        ("reward.model.dtype=float16", "reward.model.dtype: must be one of"),
    ],
)
def test_reward_mistakes_exit_before_ray(override: str, message: str) -> None:
    extra = (
        ["reward.model.path=tiny-rm:0"] if override.startswith("reward.model.worker_cls") else []
    )
    key, text = message.split(": ", 1)
    check_config_error("+recipe=grpo_tiny", override, *extra, key=key, text=text)


def test_a_model_with_several_labels_is_not_a_reward_model(tmp_path: Path) -> None:
    policy = resolve_model_path(
        "tiny:0", cache_dir=tmp_path
    )  # a causal LM: config num_labels defaults to 2
    cfg = Config(
        model=ModelConfig(path="tiny:0"), reward=RewardConfig(model=RewardModelConfig(path=policy))
    )
    with pytest.raises(
        ConfigError,
        match="reward.model.path: .* has 2 labels; a reward model is a classifier with one",
    ):
        check_reward_inputs(cfg)


def test_tiny_reward_model_is_built_and_code_rewards_say_how_they_are_sandboxed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RLFRAME_CACHE", str(tmp_path))
    cfg = Config(
        model=ModelConfig(path="tiny:0"),
        reward=RewardConfig(fn="code_tests", model=RewardModelConfig(path="tiny-rm:3")),
    )
    path = check_reward_inputs(cfg)
    assert (
        path is not None and Path(path, "config.json").is_file() and Path(path).parent == tmp_path
    )
    line = capsys.readouterr().err
    assert "rlframe: sandbox: bubblewrap" in line and "no network" in line
    assert check_reward_inputs(Config(model=ModelConfig(path="tiny:0"))) is None
