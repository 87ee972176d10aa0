"""Config errors and the small checks every section's ``__post_init__`` uses."""

from __future__ import annotations

from omegaconf import OmegaConf

if not OmegaConf.has_resolver("now"):
    # Hydra registers ``now`` too; register it here so the schema resolves outside Hydra.
    from datetime import datetime

    OmegaConf.register_new_resolver("now", lambda pattern: datetime.now().strftime(pattern))


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


def first_line(error: BaseException) -> str:
    """OmegaConf errors append a multi-line context block; keep the sentence."""
    return str(error).strip().splitlines()[0]
