"""A small config tree that the config tests change one section at a time."""

from __future__ import annotations

from rlframe.config import Config, build_config


def build(**sections: dict) -> Config:
    """A small valid config tree (tiny model, 8 prompts x 4) with ``sections`` merged into it,
    validated."""
    tree = {
        "model": {"path": "tiny:0"},
        "data": {"batch_size": 8},
        "rollout": {"n": 4},
        "actor": {"mini_batch_size": 32, "micro_batch_size": 4},
    }
    for name, values in sections.items():
        tree[name] = tree.get(name, {}) | values
    return build_config(tree)
