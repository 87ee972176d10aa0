"""A module that moved when the tree was laid out by concern fails to import with one line
naming its new place, in a user's code and in a config's dotted path alike."""

from __future__ import annotations

import importlib

import pytest

from rlframe.core.moved import MOVED
from tests.unit.cli_errors import check_config_error


@pytest.mark.parametrize("old", ["rlframe.protocol", "workers.engines.vllm_rollout"])
def test_importing_a_moved_module_names_the_new_one(old: str) -> None:
    with pytest.raises(ModuleNotFoundError, match=f"{old} moved to {MOVED[old]}"):
        importlib.import_module(old)


def test_every_new_module_exists() -> None:
    for new in MOVED.values():
        importlib.util.find_spec(new)  # raises for a missing parent package
        assert importlib.util.find_spec(new) is not None, new


def test_an_unknown_module_is_still_a_plain_error() -> None:
    with pytest.raises(ModuleNotFoundError, match="No module named 'rlframe.nothing_here'"):
        importlib.import_module("rlframe.nothing_here")


def test_a_config_naming_an_old_path_stops_with_the_new_one() -> None:
    check_config_error(
        "+recipe=grpo_tiny",
        "algorithm.advantage=rlframe.trainer:compute_advantage",
        key="algorithm.advantage",
        text="rlframe.trainer moved to rlframe.loop.trainer",
    )
