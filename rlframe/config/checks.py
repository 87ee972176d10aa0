"""Config errors and the small checks every section's ``__post_init__`` uses."""

from __future__ import annotations

from typing import Any

RENAMED_KEYS = {"critic.warmup_steps": "critic.actor_wait_steps"}
"""Keys that were renamed: old dotted key -> new one. Setting an old key is an error."""


class ConfigError(ValueError):
    """A config value or combination is invalid. ``key`` is the full dotted key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


def require(ok: bool, key: str, message: str) -> None:
    """Raise ConfigError for ``key`` unless ``ok``."""
    if not ok:
        raise ConfigError(key, message)


def require_positive(value: float, key: str) -> None:
    require(value > 0, key, f"must be > 0, got {value}")


def require_choice(value: str, allowed: tuple[str, ...], key: str) -> None:
    require(value in allowed, key, f"must be one of {list(allowed)}, got {value!r}")


def check_renamed_key(key: str) -> None:
    """Raise ConfigError for a key that was renamed, naming its new name."""
    if key in RENAMED_KEYS:
        raise ConfigError(key, f"renamed to {RENAMED_KEYS[key]}; set that instead")


def list_dotted_keys(tree: Any, prefix: str = "") -> list[str]:
    """Every key of a nested mapping, dotted (``critic.lr``), sections included."""
    keys = []
    for name, value in tree.items():
        key = f"{prefix}{name}"
        keys.append(key)
        if hasattr(value, "items"):
            keys += list_dotted_keys(value, f"{key}.")
    return keys


def first_line(error: BaseException) -> str:
    """The error's first line (OmegaConf, transformers and Ray append multi-line context
    blocks), or its type's name when it has no message."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def describe_load_error(error: BaseException) -> str:
    """A plug-in (registered name, ``module:function``, worker class) that failed to load, in
    one line for its ConfigError: the message alone for the errors a lookup raises (KeyError,
    ValueError, FileNotFoundError, AttributeError, TypeError), else the exception's type and
    its first line."""
    text = str(error).strip().strip('"')
    if isinstance(error, KeyError | ValueError | FileNotFoundError | AttributeError | TypeError):
        return text
    return f"cannot be loaded: {type(error).__name__}: {text.splitlines()[0] if text else ''}"
