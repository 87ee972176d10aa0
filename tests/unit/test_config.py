"""The CLI: composition, help and config errors, each exiting before Ray starts.

The command line runs in-process (:func:`tests.harness.check_cli`): reaching the launcher
fails the test."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlframe.config import Config, ConfigError, build_config
from rlframe.data.tiny_model import resolve_model_path
from rlframe.models.expert_parallel import check_expert_parallel
from rlframe.models.hf_config import read_model_config
from tests.harness import check_cli
from tests.unit.cli_errors import assert_config_error, check_config_error
from tests.unit.config_trees import build


@pytest.mark.parametrize(
    "override,key,allowed",
    [
        ("trainer.total_steps=abc", "trainer.total_steps", "could not be converted to Integer"),
        ("trainer.total_steps=-3", "trainer.total_steps", "must be >= 1"),
        ("rollout.n=0", "rollout.n", "must be >= 1"),
        ("actor.micro_batch_size=7", "actor.micro_batch_size", "must divide each rank's share"),
        ("actor.mini_batch_size=48", "actor.mini_batch_size", "must divide the responses per step"),
        ("trainer.stepz=3", "trainer.stepz", "keys allowed in trainer: cpus_per_proc"),
        ("trainer.device=gpu", "trainer.device", "expected one of [auto, cuda, cpu]"),
        ("rollout.engine=sglang", "rollout.engine", "expected one of [vllm, hf]"),
        ("algorithm.loss_agg=mean", "algorithm.loss_agg", "must be one of"),
    ],
)
def test_config_errors_exit_nonzero_and_name_the_key(override: str, key: str, allowed: str) -> None:
    check_config_error("+recipe=grpo_qwen", override, key=key, text=allowed)


def test_missing_model_path_points_at_recipes() -> None:
    assert_config_error(check_cli(), "model.path", "has no value", "+recipe=NAME")


def test_unknown_recipe_lists_available_ones() -> None:
    check_config_error("+recipe=nope", key="recipe", text="grpo_qwen")


def test_cfg_job_prints_composed_recipe() -> None:
    result = check_cli("+recipe=grpo_qwen", "rollout.n=16", "--cfg", "job")
    assert result.returncode == 0, result.stderr
    assert "path: Qwen/Qwen2.5-1.5B-Instruct" in result.stdout
    assert "'n': 16" in result.stdout


def test_help_lists_recipes() -> None:
    result = check_cli("--help")
    assert result.returncode == 0
    assert "recipe: " in result.stdout and "grpo_qwen" in result.stdout


def test_user_recipe_folder(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text(
        "model:\n  path: /models/mine\ntrainer:\n  total_steps: 7\n"
    )
    result = check_cli("+recipe=mine", "--cfg", "job", env={"RLFRAME_RECIPE_DIRS": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "path: /models/mine" in result.stdout and "total_steps: 7" in result.stdout
    bad = check_cli("--help", env={"RLFRAME_RECIPE_DIRS": str(tmp_path / "missing")})
    assert bad.returncode == 2 and "RLFRAME_RECIPE_DIRS" in bad.stderr


def test_a_renamed_key_names_its_new_name(tmp_path: Path) -> None:
    """critic.warmup_steps became critic.actor_wait_steps: on the command line, in a recipe
    and through build_config, the old key fails with the new name, before Ray starts."""
    renamed = "renamed to critic.actor_wait_steps"
    result = check_cli("+recipe=ppo_tiny", "critic.warmup_steps=2")
    assert result.returncode == 2 and "critic.warmup_steps" in result.stderr, result.stderr
    assert renamed in result.stderr and "Traceback" not in result.stderr
    (tmp_path / "old.yaml").write_text("critic:\n  warmup_steps: 2\n")
    result = check_cli("+recipe=old", env={"RLFRAME_RECIPE_DIRS": str(tmp_path)})
    assert result.returncode == 2 and renamed in result.stderr, result.stderr
    assert str(tmp_path / "old.yaml") in result.stderr
    with pytest.raises(ConfigError, match=renamed):
        build_config({"critic": {"warmup_steps": 2}})
    assert compose("ppo_tiny", "critic.actor_wait_steps=3").critic.actor_wait_steps == 3


def compose(recipe: str, *overrides: str) -> Config:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from rlframe.main import register_configs

    register_configs()
    with initialize_config_module(config_module="rlframe", version_base=None):
        tree = hydra_compose("rlframe", [f"+recipe={recipe}", *overrides])
    return build_config(tree)


GPU_RECIPES = {
    "grpo_qwen": "grpo",
    "ppo_qwen": "gae",
    "dapo_qwen": "grpo",
    "rloo_qwen": "rloo",
    "reinforce_pp_qwen": "reinforce_pp_baseline",
    "gspo_qwen": "grpo",
    "remax_qwen": "remax",
    "drgrpo_qwen": "grpo",
    "openai_agent_qwen": "grpo",
    "vlm_qwen": "grpo",
}


@pytest.mark.parametrize("recipe,advantage", sorted(GPU_RECIPES.items()))
def test_gpu_recipes_compose_and_validate(recipe: str, advantage: str) -> None:
    cfg = compose(recipe)
    assert cfg.trainer.device.value == "cuda" and cfg.trainer.procs_per_node == 8
    assert cfg.model.path.startswith("Qwen/Qwen2.5")
    assert cfg.algorithm.advantage == advantage
    assert cfg.critic.enable == (advantage == "gae")
    assert cfg.data.batch_size * cfg.rollout.n % cfg.actor.mini_batch_size == 0


def test_recipe_specifics() -> None:
    dapo = compose("dapo_qwen")
    assert (
        dapo.algorithm.dynamic_sampling
        and dapo.algorithm.clip_high == 0.28
        and dapo.reward.overlong_buffer > 0
    )
    assert compose("gspo_qwen").algorithm.policy_loss == "gspo"
    drgrpo = compose("drgrpo_qwen")
    assert (
        not drgrpo.algorithm.norm_by_std and drgrpo.algorithm.loss_agg == "seq-mean-token-sum-norm"
    )
    assert drgrpo.algorithm.loss_agg_norm == drgrpo.rollout.max_tokens == 1024
    assert compose("ppo_tiny").critic.enable and compose("grpo_tiny").critic.enable is False
    long = compose("grpo_qwen3_long")  # validated: the mesh, the budget over 4 ranks
    assert long.actor.sequence_parallel_size == 4 and long.rollout.max_tokens >= 16384
    moe = compose("grpo_qwen3_30b_a3b")  # validated: experts spread over each TP group of 4
    assert moe.rollout.expert_parallel and moe.rollout.tensor_parallel_size == 4
    assert moe.trainer.device.value == "cuda" and moe.trainer.procs_per_node == 8
    distill = compose("distill_qwen")  # validated: a teacher pool of 2 beside 8 ranks
    assert distill.distill.teacher == "Qwen/Qwen3-8B" and distill.distill.procs_per_node == 2
    assert distill.distill.task_weight == 0 and distill.trainer.procs_per_node == 8
    assert compose("distill_tiny").distill.placement.value == "colocated"
    agent = compose("openai_agent_qwen")
    assert agent.rollout.agent == "openai"
    assert agent.agent.entry.endswith("calculator_openai.py:solve")


def test_gae_without_critic_is_refused() -> None:
    with pytest.raises(ConfigError, match="critic.enable"):
        build_config(
            {"model": {"path": "x"}, "algorithm": {"advantage": "gae"}, "critic": {"enable": False}}
        )


def test_build_config_reports_all_cross_field_rules() -> None:
    with pytest.raises(ConfigError) as info:
        build_config(
            {
                "model": {"path": "x"},
                "trainer": {"procs_per_node": 3},
                "actor": {"mini_batch_size": 32},
            }
        )
    assert info.value.key == "actor.mini_batch_size"
    assert "multiple of the number of ranks" in str(info.value)


def test_expert_parallel_needs_experts_and_an_engine_group() -> None:
    """``rollout.expert_parallel`` spreads experts over a vLLM engine's ranks: refused with
    one rank, the hf engine or a dense model (whose config has no experts)."""
    with pytest.raises(ConfigError, match="rollout.expert_parallel: spreads the experts"):
        build(rollout={"n": 4, "expert_parallel": True})
    cfg = build(
        rollout={"n": 4, "expert_parallel": True, "tensor_parallel_size": 2},
        trainer={"procs_per_node": 2},
    )
    moe = resolve_model_path("tiny-moe:0")
    check_expert_parallel(cfg, moe, read_model_config(moe, False))
    with pytest.raises(ConfigError, match="rollout.expert_parallel: .* has no experts"):
        dense = resolve_model_path("tiny:0")
        check_expert_parallel(cfg, dense, read_model_config(dense, False))
