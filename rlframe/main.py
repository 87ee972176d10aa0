"""Command-line entry: ``python -m rlframe.main +recipe=NAME key=value ...``.

Hydra composes the schema (:mod:`rlframe.config`) with ``recipes/NAME.yaml`` and the
overrides. The composed tree is validated into dataclasses before anything heavy is
imported, so config mistakes exit within seconds, before Ray starts.

User recipes: put ``my_run.yaml`` in a folder and point ``RLFRAME_RECIPE_DIRS`` at it
(``:``-separated for several); it is then selected with ``+recipe=my_run``.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, get_origin, get_type_hints

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from rlframe.config import Config, ConfigError, build_config
from rlframe.config.checks import RENAMED_KEYS, check_renamed_key, first_line, list_dotted_keys
from rlframe.observability import startup

if TYPE_CHECKING:
    from rlframe.run.interrupts import Interrupted

BUILTIN_RECIPES = Path(__file__).resolve().parent.parent / "recipes"
RECIPE_DIRS_ENV = "RLFRAME_RECIPE_DIRS"

HELP_TEMPLATE = """rlframe: RL post-training of language models on Ray.

Usage:
  python -m rlframe.main +recipe=NAME [key=value ...]   run a recipe with overrides
  python -m rlframe.main +recipe=NAME --cfg job         print the composed config
  python -m rlframe.main --help                         this text

Recipes (add your own folders with RLFRAME_RECIPE_DIRS=dir1:dir2):
$APP_CONFIG_GROUPS
Config (every key can be overridden as key=value):

$CONFIG
"""


def find_recipe_dirs() -> list[Path]:
    """The built-in recipes folder, then every folder named in RLFRAME_RECIPE_DIRS."""
    dirs = [BUILTIN_RECIPES]
    for entry in os.environ.get(RECIPE_DIRS_ENV, "").split(":"):
        if entry:
            path = Path(entry).expanduser().resolve()
            if not path.is_dir():
                raise ConfigError(RECIPE_DIRS_ENV, f"{entry!r} is not a folder")
            dirs.append(path)
    return dirs


def register_configs() -> None:
    """Store the schema as the primary config and each recipe file in the ``recipe`` group.

    Recipes are stored with package ``_global_`` so that a recipe writes root keys
    (``trainer.total_steps: 5``) rather than keys under ``recipe.``.
    """
    store = ConfigStore.instance()
    store.store(name="rlframe_schema", node=Config)
    store.store(
        name="rlframe",
        node={
            "defaults": [
                "rlframe_schema",
                "_self_",
                # Hydra's own log file and run folder would duplicate our run directory.
                {"override hydra/job_logging": "stdout"},
                {"override hydra/hydra_logging": "none"},
            ],
            "hydra": {
                "run": {"dir": "."},
                "output_subdir": None,
                "help": {"app_name": "rlframe", "template": HELP_TEMPLATE},
            },
        },
    )
    for folder in find_recipe_dirs():
        for path in sorted(folder.glob("*.yaml")):
            store.store(
                group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_"
            )


def check_recipe_keys(args: list[str]) -> None:
    """Reject an unknown recipe (``+recipe=NAME``), and a renamed key in the chosen one with
    its new name: Hydra would report either in several lines, with status 1."""
    names = [a.split("=", 1)[1] for a in args if a.startswith("+recipe=")]
    for name in names:
        for folder in reversed(find_recipe_dirs()):
            path = folder / f"{name}.yaml"
            if path.is_file():
                for key in list_dotted_keys(OmegaConf.to_container(OmegaConf.load(path))):
                    if key in RENAMED_KEYS:
                        raise ConfigError(key, f"(in {path}) renamed to {RENAMED_KEYS[key]}")
                break
        else:
            recipes = sorted({p.stem for d in find_recipe_dirs() for p in d.glob("*.yaml")})
            raise ConfigError("recipe", f"no recipe {name!r}; recipes: {', '.join(recipes)}")


def check_override_keys(args: list[str]) -> None:
    """Reject overrides whose key is not in the schema, listing the keys allowed.

    ``key=value``: Hydra would reject an unknown key too, but without saying what the section
    accepts. ``+key=value`` / ``++key=value`` / ``~key``: Hydra would *add* or drop the key
    silently (``+trainer.total_step=5``, a typo, would run 100 steps), so only
    ``+recipe=NAME`` may use a prefix; schema keys are set with plain ``key=value``.
    """
    for arg in args:
        if (
            arg.startswith("-")
            or arg.startswith("hydra.")
            or ("=" not in arg and not arg.startswith("~"))
        ):
            continue
        key = arg.split("=", 1)[0]
        prefix = key[: len(key) - len(key.lstrip("+~"))]
        key = key[len(prefix) :]
        if key == "recipe" and prefix == "+":
            continue
        if prefix:
            if check_schema_key(key) and prefix in ("+", "++"):
                continue  # a new key of a free-form mapping (+agent.env_kwargs.NAME=VALUE)
            raise ConfigError(
                key,
                f"set schema keys as {key}=VALUE, without {prefix!r} "
                "(only +recipe=NAME takes a '+')",
            )
        check_schema_key(key)


def check_override_types(args: list[str]) -> None:
    """Reject a value of the wrong type (``trainer.total_steps=abc``) with one line naming the
    key, before Hydra does so with a block of its own (exit 1)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf.errors import OmegaConfBaseException

    plain = [a for a in args if "=" in a and not a.startswith(("+", "~", "-", "hydra."))]
    if not plain:
        return
    schema = OmegaConf.structured(Config)
    for arg in plain:
        try:
            override = OverridesParser.create().parse_overrides([arg])[0]
        except Exception:
            continue  # Hydra reports its own syntax errors
        if override.is_sweep_override():
            continue
        try:
            OmegaConf.update(schema, override.key_or_group, override.value(), merge=True)
        except OmegaConfBaseException as e:
            raise ConfigError(override.key_or_group, f"{first_line(e)} (from {arg!r})") from None


def check_schema_key(key: str) -> bool:
    """Raise ConfigError unless the dotted ``key`` names a field of the schema; True when it
    lies inside a free-form mapping such as ``agent.env_kwargs``."""
    if key.startswith("hydra."):
        return False
    check_renamed_key(key)
    node: Any = Config
    walked: list[str] = []
    for part in key.split("."):
        names = {f.name: f for f in fields(node)} if is_dataclass(node) else {}
        if part not in names:
            where = ".".join(walked) or "the config root"
            allowed = ", ".join(sorted(names)) or "none (it is a value, not a section)"
            raise ConfigError(key, f"unknown key; keys allowed in {where}: {allowed}")
        walked.append(part)
        if get_origin(get_type_hints(node)[part]) is dict:
            return True  # a free-form mapping (agent.env_kwargs): its keys are the plug-in's
        node = schema_type(node, part)
    return False


def schema_type(owner: type, name: str) -> Any:
    """The dataclass type of field ``name`` of ``owner`` (or None for a leaf value)."""
    hint = get_type_hints(owner)[name]
    return hint if is_dataclass(hint) else None


def run(cfg: Config) -> None:
    """Check the run's inputs, start or join Ray and run the training loop. The checks before
    Ray (:func:`rlframe.run.preflight.check_before_ray`) import nothing heavy: a mistake they
    find costs no torch import and no Ray start. Heavy imports happen after them.

    A worker, reward or environment failure ends the run with its own message (role, rank,
    method and the worker's traceback; the env, sample and turn), not with a driver traceback;
    so does a placement the cluster cannot satisfy (one line, within seconds when it never could),
    and a run whose rollout engine fails the sync check (exit 76, :mod:`rlframe.loop.sync_check`).
    """
    from rlframe.run.interrupts import Interrupted, install_interrupt_handlers
    from rlframe.run.preflight import check_before_ray
    from rlframe.state.run_dir import lock_run_dir

    install_interrupt_handlers()
    try:
        lock_run_dir(cfg.trainer.output_dir)  # before anything reads or writes the folder
        resume_from = check_before_ray(cfg)
    except ConfigError as e:
        say_error(f"rlframe: config error: {e}")
        sys.exit(2)
    except Interrupted as e:
        exit_interrupted(cfg, e)
    try:
        launch(cfg, resume_from)
    except Interrupted as e:  # while launch imports torch and Ray, before its own handling
        exit_interrupted(cfg, e)


def launch(cfg: Config, resume_from: Path | None) -> None:
    """:func:`rlframe.run.launch.run_training` (``resume_from``: what the checks before Ray
    resolved), each way it can end turned into its console line and exit status.

    Nothing here imports torch: the launcher starts Ray before its heavy imports, so that
    they overlap Ray's start. The failures whose classes live beside torch (a worker's, an
    env's) are recognised by :func:`is_reported_failure` once one is caught."""
    from rlframe.loop.sync_check import BROKEN_SYNC_EXIT, BrokenSyncError, describe_broken_sync
    from rlframe.run.interrupts import Interrupted, describe_position, find_interruption
    from rlframe.run.launch import run_training
    from rlframe.state.save_failures import (
        DISK_FULL_EXIT,
        CheckpointError,
        describe_full_disk,
        find_full_disk,
    )

    try:
        run_training(cfg, resume_from)  # checks the rest while Ray and the workers start
    except Interrupted as e:
        exit_interrupted(cfg, e)
    except Exception as e:
        # First: after a signal, a failure is the signal's (an import it cut short).
        interrupted = find_interruption(e)
        if interrupted is not None:
            exit_interrupted(cfg, interrupted)
        if isinstance(e, ConfigError):
            say_error(f"rlframe: config error: {e}")
            sys.exit(2)
        if isinstance(e, CheckpointError):
            say_error(f"rlframe: {e}")
            sys.exit(DISK_FULL_EXIT if e.disk_full else 1)
        if isinstance(e, BrokenSyncError):
            say_error(describe_broken_sync(e, cfg.trainer.output_dir))
            sys.exit(BROKEN_SYNC_EXIT)
        if is_reported_failure(e):
            say_error(f"rlframe: {e}")
            sys.exit(1)
        # A full disk anywhere in the run directory (metrics.jsonl, rollouts.jsonl, a resume
        # config, TensorBoard events) is the user's to fix, not a bug: one line, no traceback.
        full = find_full_disk(e)
        if full is None:
            raise
        out = cfg.trainer.output_dir
        say_error(describe_full_disk(full, out, *describe_position(out)))
        sys.exit(DISK_FULL_EXIT)


def is_reported_failure(error: Exception) -> bool:
    """A failure that carries its own one-line message (role, rank and method; the env, sample
    and turn; the placement the cluster cannot hold): a worker's, a reward's, an env's or the
    placement's. Imported here, when one is caught: the worker group's and the envs' modules
    import torch."""
    from rlframe.controller.placement import PlacementError
    from rlframe.controller.worker_group import WorkerError
    from rlframe.envs import EnvError
    from rlframe.rewards import RewardError

    return isinstance(error, WorkerError | RewardError | EnvError | PlacementError)


def exit_interrupted(cfg: Config, interrupted: Interrupted) -> NoReturn:
    """Say where the interrupted run stands and exit 128 + the signal's number."""
    from rlframe.run.interrupts import describe_interruption

    say_error(describe_interruption(cfg.trainer.output_dir))
    sys.stdout.flush()
    os._exit(interrupted.exit_code)  # Ray's atexit hooks already ran in the launcher's teardown


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def say_error(text: str) -> None:
    """Print an error line on stderr; colour codes (Ray's tracebacks carry them) only on a
    terminal."""
    if not sys.stderr.isatty():
        text = ANSI_ESCAPE.sub("", text)
    print(text, file=sys.stderr, flush=True)


@hydra.main(version_base=None, config_name="rlframe")
def hydra_main(tree: DictConfig) -> None:
    try:
        cfg = build_config(tree)
    except ConfigError as e:
        print(f"rlframe: config error: {e}", file=sys.stderr)
        sys.exit(2)
    startup.DRIVER.mark("config")
    run(cfg)


def main() -> None:
    startup.begin_driver_clock()
    from rlframe.run.interrupts import Interrupted, install_interrupt_handlers

    # First: a Ctrl-C while Hydra composes the config is one line too, not a traceback.
    install_interrupt_handlers()
    try:
        try:
            check_override_keys(sys.argv[1:])
            check_override_types(sys.argv[1:])
            check_recipe_keys(sys.argv[1:])
            register_configs()
        except ConfigError as e:
            print(f"rlframe: config error: {e}", file=sys.stderr)
            sys.exit(2)
        hydra_main()
    except Interrupted as e:  # before the config was built: nothing was started or written
        say_error("rlframe: interrupted before step 1 finished; the same command starts again")
        sys.stdout.flush()
        os._exit(e.exit_code)


if __name__ == "__main__":
    main()
