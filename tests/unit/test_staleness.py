"""The staleness rules against hand-worked cases: the bound, earliest-deadline-first
selection, admission, and the off_policy/* metrics."""

from __future__ import annotations

import pytest
import torch

from rlframe.config import ConfigError, build_config
from rlframe.rollout.staleness import (
    GroupView,
    compute_off_policy_metrics,
    count_admissible,
    find_over_bound,
    is_due,
    is_within_bound,
    select_step_groups,
)


def test_bound_and_due() -> None:
    # k=1, the update starts from version 3: version 2 is the last usable and due now.
    assert is_within_bound(2, 3, 1) and not is_within_bound(1, 3, 1)
    assert is_due(2, 3, 1) and not is_due(3, 3, 1)
    # k=0: only the current version, and everything is due.
    assert is_within_bound(3, 3, 0) and not is_within_bound(2, 3, 0) and is_due(3, 3, 0)
    groups = [GroupView(0, 1, True), GroupView(1, 2, False), GroupView(2, 0, False)]
    assert find_over_bound(groups, 3, 1) == [0, 2]


def test_selection_is_earliest_deadline_first() -> None:
    groups = [
        GroupView(5, 2, True),
        GroupView(3, 3, True),
        GroupView(4, 2, True),
        GroupView(6, 3, False),
    ]
    # Oldest version first, ties by admission order; unfinished groups are never taken.
    assert select_step_groups(groups, 2, 3, 1, wait_for_due=True) == [4, 5]
    assert select_step_groups(groups, 3, 3, 1, wait_for_due=True) == [4, 5, 3]
    assert select_step_groups(groups, 4, 3, 1, wait_for_due=True) is None


def test_wait_holds_the_step_for_a_due_straggler_and_drop_does_not() -> None:
    groups = [GroupView(0, 2, False), GroupView(1, 3, True), GroupView(2, 3, True)]
    # Group 0 (version 2) is due at version 3 with k=1: wait keeps the step waiting for it.
    assert select_step_groups(groups, 2, 3, 1, wait_for_due=True) is None
    assert select_step_groups(groups, 2, 3, 1, wait_for_due=False) == [1, 2]
    # At k=2 it is not due yet: both modes go on without it.
    assert select_step_groups(groups, 2, 3, 2, wait_for_due=True) == [1, 2]
    # Over the bound it is ignored (the producer drops it) rather than waited for.
    assert select_step_groups(groups, 2, 4, 0, wait_for_due=True) is None
    over = [GroupView(0, 1, True), GroupView(1, 3, True)]
    assert select_step_groups(over, 1, 3, 1, wait_for_due=True) == [1]


def test_admission_keeps_every_deadline() -> None:
    # k=0: one step's groups at a time (lockstep).
    assert count_admissible(0, 0, 4, 0) == 4
    assert count_admissible(4, 0, 4, 0) == 0
    assert count_admissible(4, 1, 4, 0) == 4
    # k=1: two steps' worth ahead at the start, then one step's worth per update.
    assert count_admissible(0, 0, 4, 1) == 8
    assert count_admissible(8, 0, 4, 1) == 0
    assert count_admissible(8, 1, 4, 1) == 4
    # Dropped groups leave the count, so their slots are admitted again.
    assert count_admissible(6, 1, 4, 1) == 6


def test_off_policy_metrics_by_hand() -> None:
    # Row 0: versions 1,1,2 (crossed a sync); row 1: 2,2 then padding; row 2: empty (version 2).
    versions = torch.tensor([[1, 1, 2], [2, 2, 2], [2, 2, 2]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    m = compute_off_policy_metrics(versions, mask, current_version=3, dropped=2)
    assert m["off_policy/staleness_mean"] == pytest.approx((2 + 1 + 1) / 3)
    assert m["off_policy/staleness_max"] == 2
    assert m["off_policy/version_span_mean"] == pytest.approx(1 / 3)
    assert m["off_policy/partial_frac"] == pytest.approx(1 / 3)
    assert m["off_policy/dropped"] == 2


def test_async_keys_are_checked_before_ray() -> None:
    base = {"model": {"path": "tiny:0"}}
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        build_config(base | {"rollout": {"max_staleness": -1}})
    with pytest.raises(ConfigError, match="rollout.partial_chunk_tokens"):
        build_config(base | {"rollout": {"partial_chunk_tokens": -2}})
    # The openai agent, DAPO's dynamic sampling and ReMax run under the one producer.
    openai = {"rollout": {"max_staleness": 1, "agent": "openai"}, "agent": {"entry": "a.py:f"}}
    assert build_config(base | openai).rollout.agent == "openai"
    episodes = {"agent": "multi_turn", "max_staleness": 1}
    with pytest.raises(ConfigError, match="rollout.partial_chunk_tokens"):
        build_config(
            base | {"rollout": episodes | {"partial_chunk_tokens": 8}, "agent": {"env": "guess"}}
        )
    cfg = build_config(base | {"rollout": episodes, "agent": {"env": "guess"}})
    assert cfg.rollout.max_staleness == 1
    dapo = {"rollout": {"max_staleness": 1}, "algorithm": {"dynamic_sampling": True}}
    assert build_config(base | dapo).algorithm.dynamic_sampling
    remax = {"rollout": {"max_staleness": 2}, "algorithm": {"advantage": "remax"}}
    assert build_config(base | remax).algorithm.advantage == "remax"
    with pytest.raises(Exception, match="stale_groups"):
        build_config(base | {"rollout": {"max_staleness": 1, "stale_groups": "later"}})
    cfg = build_config(base | {"rollout": {"max_staleness": 1, "stale_groups": "drop"}})
    assert cfg.rollout.stale_groups.value == "drop"


def test_the_staleness_bound_must_fit_the_run_and_lockstep_refuses_async_keys() -> None:
    base = {"model": {"path": "tiny:0"}}
    short = {"trainer": {"total_steps": 2}}
    with pytest.raises(ConfigError, match="rollout.max_staleness: 3 exceeds the run's trainer"):
        build_config(base | short | {"rollout": {"max_staleness": 3}})
    assert build_config(base | short | {"rollout": {"max_staleness": 2}}).rollout.max_staleness
    long = {"trainer": {"total_steps": 1_000_000}, "data": {"batch_size": 32}}
    rollout = {"max_staleness": 100_000, "n": 8}
    with pytest.raises(ConfigError, match="rollout.max_staleness: .* at most 255 here"):
        build_config(base | long | {"rollout": rollout})
    assert build_config(base | long | {"rollout": rollout | {"max_staleness": 255}})
    with pytest.raises(ConfigError, match="rollout.partial_chunk_tokens: has no effect at"):
        build_config(base | {"rollout": {"partial_chunk_tokens": 16}})
    with pytest.raises(ConfigError, match="rollout.stale_groups: has no effect at"):
        build_config(base | {"rollout": {"stale_groups": "drop"}})
