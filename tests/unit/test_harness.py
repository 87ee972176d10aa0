"""The harness's guard: a command given to ``check_cli`` that would start Ray fails the test,
even though Hydra turns exceptions in the run into exit 1."""

from __future__ import annotations

import pytest

from tests.harness import LauncherReached, check_cli


def test_a_valid_command_reaches_the_launcher_and_is_refused() -> None:
    with pytest.raises(LauncherReached, match="reached the launcher"):
        check_cli("+recipe=grpo_tiny", "trainer.total_steps=1")


def test_a_config_error_stops_before_the_launcher() -> None:
    result = check_cli("+recipe=grpo_tiny", "trainer.total_steps=0")
    assert result.returncode == 2 and "trainer.total_steps" in result.stderr
