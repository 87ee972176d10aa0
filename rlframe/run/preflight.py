"""Checks of everything a run reads, on the driver, before and as Ray and the workers start.

The schema (``rlframe/config/``) checks values and their combinations; this module checks
what those values *point at*: registered names and users' plug-in files, worker classes,
the model folder and tokenizer, and the prompt data. Each failure is a :class:`ConfigError`
naming the key, so the command exits with one clear line within seconds instead of a
traceback from a worker. The checks against the model's own config are
:mod:`rlframe.models.checks`, the agent's :mod:`rlframe.run.agent_preflight`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlframe.config import Config, ConfigError, Device, Placement, first_line
from rlframe.config.checks import describe_load_error
from rlframe.config.device import count_local_gpus, will_start_local_ray, will_train_on_cuda
from rlframe.core.tokenizer import Tokenizer, as_tokenizer
from rlframe.models.checks import run_model_checks
from rlframe.models.hf_config import read_config_json, read_model_config
from rlframe.models.lora_targets import check_lora_targets
from rlframe.run.agent_preflight import check_agent, check_server_port
from rlframe.state.run_dir import check_resume_processor

if TYPE_CHECKING:
    from rlframe.data.prompts import PromptRecord


@dataclass
class WorkerInputs:
    """What the workers are built from, resolved by :func:`check_worker_inputs`."""

    model_path: str
    """A loadable model directory (``tiny:N`` built) or a model id."""
    resume_from: Path | None
    """The checkpoint the run continues from; None for a fresh run."""
    reward_model_path: str | None = None
    """The reward model's directory (``tiny-rm:N`` built) or hub id; None without one."""
    served_paths: dict[str, str] = field(default_factory=dict)
    """Each served model's (teachers, judges) directory or hub id, by name."""


@dataclass
class RunInputs:
    """What the checks resolved, handed to the run so nothing is loaded twice."""

    model_path: str
    """A loadable model directory (``tiny:N`` built) or a model id."""
    tokenizer: Tokenizer
    records: list[PromptRecord]
    """The training prompts, tokenised."""
    val_records: list[PromptRecord] | None
    """The validation prompts; None when validation is off."""
    resume_from: Path | None
    """The checkpoint the run continues from; None for a fresh run."""
    reward_model_path: str | None = None
    """The reward model's directory (``tiny-rm:N`` built) or hub id; None without one."""


def check_run_inputs(cfg: Config) -> RunInputs:
    """Every check, in the order a run makes them (:func:`check_before_ray`, then
    :func:`check_worker_inputs` while Ray starts, then :func:`check_driver_inputs` while the
    workers start); raise ConfigError."""
    resume_from = check_before_ray(cfg)
    return check_driver_inputs(cfg, check_worker_inputs(cfg, resume_from))


def check_before_ray(cfg: Config) -> Path | None:
    """The cheap checks a run makes before it starts Ray: the run directory (resumed or
    refused, never overwritten; returns the checkpoint it continues from), for a Ray it
    starts itself that the worker pools fit the machine, the config against a local model's
    ``config.json`` (:func:`check_model_before_ray`) and a fixed agent server port."""
    from rlframe.state.checkpoint import resolve_resume

    resume_from = resolve_resume(cfg)
    check_local_pools(cfg)
    check_model_before_ray(cfg)
    if cfg.rollout.agent == "openai":
        check_server_port(cfg.agent.server_host, cfg.agent.server_port)
    return resume_from


def check_model_before_ray(cfg: Config) -> None:
    """:data:`rlframe.models.checks.MODEL_CHECKS` on the fields of the model's local
    ``config.json`` (a folder, or a tiny model already built in the cache): a file read, no
    transformers, so a mistake against the model costs no Ray start. A hub id, a tiny model
    not built yet, or a field only transformers fills in is checked again (with transformers'
    config) while the workers start."""
    from rlframe.data.tiny_vl_model import resolve_tiny_vl_path

    try:
        path = resolve_tiny_vl_path(cfg.model.path, build=False)
    except ValueError:
        return  # a malformed tiny:N: resolve_model_files names it
    config = read_config_json(path)
    if config is not None:
        run_model_checks(cfg, path, config)
    check_teacher_vocab(cfg, path, build=False)


def check_teacher_vocab(cfg: Config, student: str, build: bool) -> None:
    """Every teacher shares the student's tokenizer (where both are local folders; tiny ones
    are read once built: ``build``)."""
    from rlframe.config.served_models import list_served_models
    from rlframe.data.tiny_vl_model import resolve_tiny_vl_path
    from rlframe.models.vocab import check_same_vocab

    for spec in list_served_models(cfg):
        if spec.section != "distill":
            continue
        try:
            teacher = resolve_tiny_vl_path(spec.path, build=build)
        except ValueError:
            continue  # a malformed tiny id: resolving it names the key
        check_same_vocab(student, teacher, spec.key)


def check_worker_inputs(cfg: Config, resume_from: Path | None) -> WorkerInputs:
    """What the workers are built from, checked while Ray starts: plug-ins and worker classes
    (imported here: the driver starts the workers from them), the reward inputs and the model
    folder. Raise ConfigError."""
    check_plugins(cfg)
    reward_model_path = check_reward_inputs(cfg)
    return WorkerInputs(
        resolve_model_files(cfg), resume_from, reward_model_path, resolve_served_models(cfg)
    )


def check_driver_inputs(cfg: Config, found: WorkerInputs) -> RunInputs:
    """What the driver feeds the workers, checked while they start: the tokenizer, the agent
    and its chat template, the model's limits against the config, and the prompts. Raise
    ConfigError."""
    from rlframe.loop.validation import split_validation_records

    model_path = found.model_path
    tokenizer = load_tokenizer(cfg, model_path)
    # The model's own limits go before the agent's chat template: they name the real limit
    # where the template check would name a symptom. Checked before Ray on config.json's own
    # fields; here with transformers' config (what that could not read or derive).
    run_model_checks(cfg, model_path, read_model_config(model_path, cfg.model.trust_remote_code))
    check_lora_targets(cfg, model_path)
    check_teacher_vocab(cfg, model_path, build=True)
    if found.resume_from is not None:
        check_resume_processor(model_path, found.resume_from)
    check_agent(cfg, tokenizer)
    records = load_training_prompts(cfg, tokenizer)
    try:
        records, val_records = split_validation_records(records, cfg, tokenizer)
    except ValueError as e:
        raise ConfigError(
            "data.val_files" if cfg.data.val_files else "data.val_size", str(e)
        ) from None
    return RunInputs(
        model_path, tokenizer, records, val_records, found.resume_from, found.reward_model_path
    )


# Rule rewards that need more than the standard library, and the package each needs.
REWARD_PACKAGES = {"math_verify": "math_verify"}


def check_reward_inputs(cfg: Config) -> str | None:
    """The rule reward's package is installed, the sandbox says what isolation it has, and the
    reward model (if any) is a one-label classifier whose worker class loads. Returns the
    reward model's path (``tiny-rm:N`` built), or None."""
    import importlib.util

    r = cfg.reward
    package = REWARD_PACKAGES.get(r.fn)
    if r.uses_rule and package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError(
            "reward.fn",
            f"{r.fn} needs the {package.replace('_', '-')} package: "
            f"pip install {package.replace('_', '-')}",
        )
    if r.uses_rule and r.fn == "code_tests":
        from rlframe.rewards.sandbox import detect_isolation
        from rlframe.rewards.sandbox_command import SandboxUnavailable

        try:
            print(detect_isolation().describe(), file=sys.stderr)
        except SandboxUnavailable as e:
            raise ConfigError("reward.fn", f"code_tests runs untrusted code, but {e}") from None
    if not r.uses_model:
        return None
    return check_reward_model(cfg)


def check_reward_model(cfg: Config) -> str:
    from rlframe.core.registry import load_class
    from rlframe.data.tiny_reward_model import is_tiny_reward_model, resolve_reward_model_path

    rm = cfg.reward.model
    assert rm.path is not None
    try:
        load_class(rm.worker_cls)
    except Exception as e:
        raise ConfigError("reward.model.worker_cls", describe_load_error(e)) from None
    try:
        path = resolve_reward_model_path(rm.path)
    except ValueError as e:
        raise ConfigError("reward.model.path", str(e)) from None
    local = Path(path).expanduser()
    if not local.exists() and not is_tiny_reward_model(rm.path) and not looks_like_model_id(path):
        raise ConfigError("reward.model.path", f"no such folder {path}")
    if local.exists() and not (local / "config.json").is_file():
        raise ConfigError(
            "reward.model.path", f"{path} holds no config.json: point it at a saved model folder"
        )
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=rm.trust_remote_code)
    except Exception as e:
        reason = first_line(e)
        raise ConfigError(
            "reward.model.path",
            f"{path!r} cannot be loaded as a model (offline, or a typo?): {reason}",
        ) from None
    if config.num_labels != 1:
        raise ConfigError(
            "reward.model.path",
            f"{path} has {config.num_labels} labels; a reward model is a classifier with one "
            "(num_labels=1)",
        )
    return path


def check_plugins(cfg: Config) -> None:
    """Every registered name exists and every ``module:function`` / ``file.py:function`` loads."""
    from rlframe.algorithms.advantages import ADVANTAGES
    from rlframe.algorithms.losses import POLICY_LOSSES
    from rlframe.controller.dispatch import find_dispatch_methods
    from rlframe.controller.roles import check_role
    from rlframe.core.registry import Registry, load_class
    from rlframe.rewards import REWARDS

    entries: list[tuple[str, str, Registry[Any]]] = [
        ("algorithm.advantage", cfg.algorithm.advantage, ADVANTAGES),
        ("algorithm.policy_loss", cfg.algorithm.policy_loss, POLICY_LOSSES),
    ]
    if cfg.reward.fn != "auto":
        entries.append(("reward.fn", cfg.reward.fn, REWARDS))
    judge = cfg.reward.judge
    if judge.enabled:
        from rlframe.judges.scorers import JUDGE_PARSERS, JUDGE_SCORERS  # built-ins in

        entries.append(("reward.judge.scorer", judge.scorer, JUDGE_SCORERS))
        if judge.scorer == "verdict":
            entries.append(("reward.judge.parser", judge.parser, JUDGE_PARSERS))
    for key, name, registry in entries:
        try:
            registry.get(name)
        except Exception as e:  # a user's file may raise anything while it is imported
            raise ConfigError(key, describe_load_error(e)) from None
    for key, path, role in list_worker_roles(cfg):
        try:
            worker_cls = load_class(path)
        except Exception as e:
            raise ConfigError(key, describe_load_error(e)) from None
        try:
            check_role(role, worker_cls, find_dispatch_methods(worker_cls))
        except TypeError as e:
            raise ConfigError(key, str(e)) from None


def list_worker_roles(cfg: Config) -> list[tuple[str, str, type]]:
    """(config key, worker class path, role Protocol) of every group the run starts."""
    from rlframe.config.placement import resolve_actor_worker_cls
    from rlframe.controller import roles

    separate = cfg.rollout.placement is Placement.separate
    found: list[tuple[str, str, type]] = [
        (
            "actor.worker_cls",
            resolve_actor_worker_cls(cfg.rollout, cfg.actor),
            roles.TrainGroup if separate else roles.HybridGroup,
        )
    ]
    if separate:
        found.append(("rollout.worker_cls", cfg.rollout.worker_cls, roles.RolloutGroup))
    if cfg.critic.enable:
        found.append(("critic.worker_cls", cfg.critic.worker_cls, roles.CriticGroup))
    return found


def check_local_pools(cfg: Config) -> None:
    """When this run starts its own one-machine Ray: the worker pools fit the machine (its
    CPUs, and its GPUs when the run will train on them)."""
    from rlframe.config.placement import check_pools_fit, check_pools_gpus
    from rlframe.config.served_models import list_served_models

    if not will_start_local_ray(cfg.ray):
        return
    served = tuple(spec.pool for spec in list_served_models(cfg) if spec.pool is not None)
    if cfg.ray.num_cpus:
        check_pools_fit(cfg.rollout, cfg.trainer, cfg.ray.num_cpus, "ray.num_cpus", served)
    else:
        cpus, source = os.cpu_count() or 1, "this machine's CPUs; ray.num_cpus overrides"
        check_pools_fit(cfg.rollout, cfg.trainer, cpus, source, served)
    if cfg.trainer.device is Device.cpu:
        return  # no GPU count: it imports torch, a second on the way to starting Ray
    gpus = count_local_gpus()
    if will_train_on_cuda(cfg, gpus):
        check_pools_gpus(cfg.rollout, cfg.trainer, gpus, "the GPUs this process can see", served)


def load_model_files(cfg: Config) -> tuple[str, Tokenizer]:
    """The model directory (building ``tiny:N``, ``tiny-vl:N``) and its tokenizer."""
    path = resolve_model_files(cfg)
    return path, load_tokenizer(cfg, path)


def resolve_model_files(cfg: Config) -> str:
    """The model directory (building ``tiny:N``, ``tiny-vl:N``): a folder with a config.json
    and loadable weights, or a model id."""
    return resolve_model_folder(cfg.model.path, "model.path")


def resolve_model_folder(configured: str, key: str) -> str:
    """``configured`` (the value of ``key``) as a loadable model: a folder with a
    config.json and loadable weights (``tiny:N`` and friends built), or a model id."""
    from rlframe.data.tiny_model import TINY_JUDGE_PREFIX, is_tiny_model
    from rlframe.data.tiny_vl_model import resolve_tiny_vl_path
    from rlframe.judges.tiny_judge import resolve_tiny_judge_path

    try:
        if configured.startswith(TINY_JUDGE_PREFIX):
            path = resolve_tiny_judge_path(configured)  # trained on first use
        else:
            path = resolve_tiny_vl_path(configured)
    except ValueError as e:
        raise ConfigError(key, str(e)) from None
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ConfigError(key, f"{path} holds no config.json: point it at a saved model folder")
        from rlframe.models.weights import check_model_weights

        check_model_weights(local)
    elif not is_tiny_model(configured) and not looks_like_model_id(path):
        raise ConfigError(key, f"no such folder {path}")
    return path


def resolve_served_models(cfg: Config) -> dict[str, str]:
    """Each served model's folder (teachers, judges; tiny ones built), by name."""
    from rlframe.config.served_models import list_served_models

    return {
        spec.name: resolve_model_folder(spec.path, spec.key) for spec in list_served_models(cfg)
    }


def load_tokenizer(cfg: Config, path: str) -> Tokenizer:
    """The tokenizer of the model at ``path`` (a folder or a model id)."""
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    except Exception as e:
        reason = first_line(e)
        raise ConfigError(
            "model.path",
            f"{path!r} is not a local folder and its tokenizer cannot be loaded as a Hugging Face "
            f"model id (offline, or a typo?): {reason}",
        ) from None
    return as_tokenizer(loaded)


def looks_like_model_id(path: str) -> bool:
    """``org/name`` or ``name``, as on the Hugging Face hub; anything else is meant as a folder."""
    parts = path.split("/")
    return len(parts) <= 2 and all(parts) and not path.startswith((".", "~"))


def load_training_prompts(cfg: Config, tokenizer: Tokenizer) -> list[PromptRecord]:
    """The training prompts; a bad file, too few prompts or prompts all too long is an error,
    and prompts left out for length are counted on the console."""
    from rlframe.data.prompts import read_prompt_rows, tokenize_prompts

    key = "data.train_files" if cfg.data.train_files else "data.task"
    try:
        rows = read_prompt_rows(cfg.data.train_files, cfg.data.task, cfg.trainer.seed)
        prompts = tokenize_prompts(rows, tokenizer, cfg.data.max_prompt_length)
    except ValueError as e:
        raise ConfigError(key, str(e)) from None
    limit = cfg.data.max_prompt_length
    if prompts.dropped:
        print(
            f"rlframe: data: {prompts.dropped} of {len(rows)} prompts dropped: longer than "
            f"data.max_prompt_length={limit} tokens",
            file=sys.stderr,
        )
    if len(prompts.records) < cfg.data.batch_size:
        raise ConfigError(
            "data.batch_size",
            f"{cfg.data.batch_size} exceeds the {len(prompts.records)} prompts available "
            f"({len(rows)} rows, {prompts.dropped} longer than data.max_prompt_length={limit})",
        )
    return prompts.records
