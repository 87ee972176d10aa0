"""What a command line that stops on a config error must show: exit status 2, the error on
one line that names the key, no traceback. The command runs in-process
(:func:`tests.harness.check_cli`), which fails if the launcher (Ray) is reached."""

from __future__ import annotations

import os

from tests.harness import CliResult, check_cli

ERROR_PREFIX = "rlframe: config error: "
JOINING = {"RAY_ADDRESS": "ray-must-not-start:1"}
"""A run that would join this (unreachable) cluster: the checks that hold for a Ray the run
starts itself (its pools fit this machine's CPUs) are skipped, so the outcome does not
depend on the machine, and a Ray start would fail loudly."""


def assert_config_error(result: CliResult, key: str, *texts: str, alone: bool = True) -> str:
    """Exit 2 with one ``rlframe: config error: KEY: ...`` line holding every one of ``texts``;
    ``alone``: that line is all of stderr. Returns the line."""
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith(ERROR_PREFIX)]
    assert len(errors) == 1, result.stderr[-3000:]
    line = errors[0]
    assert line.startswith(f"{ERROR_PREFIX}{key}: "), line
    for text in texts:
        assert text in line, line
    if alone:
        assert result.stderr.strip().splitlines() == [line], result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    return line


def check_config_error(
    *args: str,
    key: str,
    text: str,
    alone: bool = True,
    local_ray: bool = False,
    before_ray: bool = False,
) -> str:
    """Run ``args`` in-process and assert it stops on the config error of ``key`` (see
    :func:`assert_config_error`). The run joins a cluster (:data:`JOINING`) unless
    ``local_ray``: then it would start its own, and RAY_ADDRESS must not be set.
    ``before_ray``: the error must come from the checks before Ray starts (the launcher, which
    starts Ray, is never reached)."""
    if local_ray:
        assert "RAY_ADDRESS" not in os.environ, "a local-Ray check with RAY_ADDRESS set"
    result = check_cli(*args, env=None if local_ray else JOINING, before_ray=before_ray)
    line = assert_config_error(result, key, text, alone=alone)
    assert "ray-must-not-start" not in result.stderr + result.stdout
    return line
