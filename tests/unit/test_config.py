"""The CLI: composition, help and config errors, each exiting before Ray starts."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rlframe.config import Config, ConfigError, build_config

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    # A config error must never reach Ray: make any Ray start fail loudly if one happens.
    full_env["RAY_ADDRESS"] = "ray-must-not-start:1"
    # Never the recipe's own outputs/<name>: a quickstart run there must not change results.
    if not any(a.startswith("trainer.output_dir=") or a in ("--cfg", "--help") for a in args):
        args = (*args, f"trainer.output_dir={tempfile.mkdtemp(prefix='rlframe-cli-')}/run")
    return subprocess.run(
        [sys.executable, "-m", "rlframe.main", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env=full_env,
        cwd=REPO,
    )


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
    result = run_cli("+recipe=grpo_qwen", override)
    assert result.returncode == 2, result.stderr
    assert key in result.stderr and allowed in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert "ray-must-not-start" not in result.stderr


def test_missing_model_path_points_at_recipes() -> None:
    result = run_cli()
    assert result.returncode == 2
    assert "model.path: has no value" in result.stderr and "+recipe=NAME" in result.stderr


def test_unknown_recipe_lists_available_ones() -> None:
    result = run_cli("+recipe=nope")
    assert result.returncode == 2, result.stderr
    assert "grpo_qwen" in result.stderr and "Traceback" not in result.stderr


def test_cfg_job_prints_composed_recipe() -> None:
    result = run_cli("+recipe=grpo_qwen", "rollout.n=16", "--cfg", "job")
    assert result.returncode == 0, result.stderr
    assert "path: Qwen/Qwen2.5-1.5B-Instruct" in result.stdout
    assert "'n': 16" in result.stdout


def test_help_lists_recipes() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    assert "recipe: " in result.stdout and "grpo_qwen" in result.stdout


def test_user_recipe_folder(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text(
        "model:\n  path: /models/mine\ntrainer:\n  total_steps: 7\n"
    )
    result = run_cli("+recipe=mine", "--cfg", "job", env={"RLFRAME_RECIPE_DIRS": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "path: /models/mine" in result.stdout and "total_steps: 7" in result.stdout
    bad = run_cli("--help", env={"RLFRAME_RECIPE_DIRS": str(tmp_path / "missing")})
    assert bad.returncode == 2 and "RLFRAME_RECIPE_DIRS" in bad.stderr


def test_a_renamed_key_names_its_new_name(tmp_path: Path) -> None:
    """critic.warmup_steps became critic.actor_wait_steps: on the command line, in a recipe
    and through build_config, the old key fails with the new name, before Ray starts."""
    renamed = "renamed to critic.actor_wait_steps"
    result = run_cli("+recipe=ppo_tiny", "critic.warmup_steps=2")
    assert result.returncode == 2 and "critic.warmup_steps" in result.stderr, result.stderr
    assert renamed in result.stderr and "Traceback" not in result.stderr
    (tmp_path / "old.yaml").write_text("critic:\n  warmup_steps: 2\n")
    result = run_cli("+recipe=old", env={"RLFRAME_RECIPE_DIRS": str(tmp_path)})
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


def test_the_schema_imports_nothing_heavy() -> None:
    """The schema validates without torch or the algorithm registries (no import cycle)."""
    code = (
        "import sys, rlframe.config\n"
        "heavy = [m for m in ('torch', 'rlframe.algorithms.losses',"
        " 'rlframe.algorithms.advantages') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=REPO)


def test_importing_the_driver_imports_no_vllm_and_no_cuda() -> None:
    code = (
        "import sys, rlframe, rlframe.main, rlframe.config, rlframe.protocol\n"
        "import rlframe.controller.worker_group, rlframe.controller.placement\n"
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), "
        "'vllm imported'\n"
        "import torch; assert not torch.cuda.is_initialized(), 'cuda initialised'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=REPO)
