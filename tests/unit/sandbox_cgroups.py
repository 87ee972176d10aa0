"""The sandbox cgroups on this machine that this code made, for the sandbox tests' checks
that nothing is left behind."""

from __future__ import annotations

from pathlib import Path

from rlframe.rewards.sandbox_cgroups import PREFIX, available_controllers


def owned_cgroups() -> set[Path]:
    """Sandbox cgroups named after their owner's pid (this code's naming)."""
    found = set()
    for root in set(available_controllers().values()):
        found |= {
            g for g in root.glob(f"{PREFIX}*") if g.name[len(PREFIX) :].split("-")[0].isdigit()
        }
    return found
