"""Name -> function registries with a dotted-path escape hatch for users' own functions.

A config value that names a registered entry picks it; a value of the form
``pkg.module:function`` or ``path/to/file.py:function`` loads the user's function instead,
so a new advantage estimator or loss never needs an edit to rlframe.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """Functions of one kind (``advantage``, ``policy loss``...) by name."""

    def __init__(self, kind: str, served_elsewhere: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self.entries: dict[str, F] = {}
        self.served_elsewhere = served_elsewhere
        """Built-in names a caller picks before asking this registry (listed in its errors)."""

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator adding a function under ``name``; a second use of a name is an error."""

        def add(fn: F) -> F:
            if name in self.entries:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered "
                    f"({self.entries[name].__qualname__})"
                )
            self.entries[name] = fn
            return fn

        return add

    def get(self, name: str) -> F:
        """The function registered as ``name``, or the one a ``module:function`` path names."""
        if ":" in name:
            return load_function(name)  # type: ignore[return-value]
        if name not in self.entries:
            raise KeyError(
                f"unknown {self.kind} {name!r}; registered: "
                f"{sorted([*self.entries, *self.served_elsewhere])}, or give "
                "'pkg.module:function' / 'path/to/file.py:function'"
            )
        return self.entries[name]

    def __contains__(self, name: str) -> bool:
        return ":" in name or name in self.entries


def absolutize(spec: str) -> str:
    """``rel/file.py:fn`` -> ``/abs/rel/file.py:fn``, so that workers whose working folder
    differs from the driver's load the same file. Names and module paths are unchanged."""
    target, sep, attr = spec.rpartition(":")
    if sep and target.endswith(".py"):
        return f"{Path(target).expanduser().resolve()}:{attr}"
    return spec


def load_class(path: str) -> type:
    """``pkg.module.Class`` -> the class (worker classes are named by dotted path)."""
    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError(f"{path!r} is not a dotted path 'pkg.module.Class'")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"{path!r} cannot be imported: {e}") from e
    if not isinstance(cls, type):
        raise TypeError(f"{path!r} is not a class")
    return cls


def load_function(spec: str) -> Callable[..., Any]:
    """Import ``pkg.module:function`` or ``path/to/file.py:function``."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"{spec!r} is not of the form 'pkg.module:function' or 'file.py:function'")
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"{spec!r}: no file {path}")
        module_spec = importlib.util.spec_from_file_location(f"rlframe_plugin_{path.stem}", path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn: object = getattr(module, attr, None)
    if fn is None:
        raise AttributeError(f"{spec!r}: {target} has no function {attr!r}")
    if not callable(fn):
        raise TypeError(f"{spec!r}: {attr!r} in {target} is not callable")
    return fn
