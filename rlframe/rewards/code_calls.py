"""Assert-style test cases, checked outside the sandbox against the program's values.

The program runs in the sandbox under :mod:`rlframe.rewards.call_server`, which loads it and
answers calls. The assert runs here, in the reward worker. It sees the program only through
its *free names* (read from the compiled assert: names it uses but does not bind itself)
that are neither builtins nor standard modules: each such name the program defines is bound
to a :class:`Remote` proxy, so ``add(1, 2)`` sends the call into the sandbox and comes back
as plain data read with ``ast.literal_eval`` (or as another proxy for an object). ``set``,
``abs``, ``sorted``... are always this process's builtins and ``math.isclose`` this
process's ``math``, whatever the program defines under those names. The assert's
comparison, its expected values and its success all live in this process, so a case passes
only if the assert ran to its end, and no exit code, exception hook, builtin override,
shadowed builtin, printed text or equality-faking object of the program's can change that.
A proxy refuses truth tests and comparisons: ``assert solve()`` on an object fails. An
exception the program raises reaches the assert as the nearest built-in exception type with
the same arguments (``ValueError("b is 0")``), so an assert that expects one can pass;
``StopIteration`` arrives as ``RuntimeError``, so it cannot end the assert's loops early.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import json
import os
import secrets
import select
import subprocess
import symtable
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from rlframe.rewards.sandbox import Sandbox
from rlframe.rewards.sandbox_command import WORK, SandboxLimits

SERVER = Path(__file__).with_name("call_server.py")
MAX_ANSWER_BYTES = 1 << 20
"""A longer answer line fails the case: the program must not fill the worker's memory."""


class CaseFailed(Exception):
    """The program did not answer: it exited, hung, or failed to load."""


class Session:
    """The pipes to one sandboxed call server, read under the sandbox's deadline."""

    def __init__(self, box: Sandbox) -> None:
        assert box.proc.stdin is not None and box.proc.stdout is not None
        self.box, self.to_box, self.from_box = box, box.proc.stdin, box.proc.stdout
        os.set_blocking(self.to_box.fileno(), False)  # a program that stops reading must not
        self.buffer = b""  # block the worker past the deadline

    def read_line(self) -> dict[str, Any]:
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.from_box], [], [], self.box.time_left())
            chunk = self.from_box.read1(1 << 16) if ready else b""  # type: ignore[attr-defined]
            if not chunk:
                raise CaseFailed("the program ended or ran out of time")
            self.buffer += chunk
            if len(self.buffer) > MAX_ANSWER_BYTES:
                raise CaseFailed("an answer longer than MAX_ANSWER_BYTES")
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            raise CaseFailed("garbled answer") from None
        if not isinstance(message, dict):
            raise CaseFailed("garbled answer")
        return message

    def send(self, data: bytes) -> None:
        fd = self.to_box.fileno()
        while data:
            _, ready, _ = select.select([], [fd], [], self.box.time_left())
            if not ready:
                raise CaseFailed("the program stopped reading and ran out of time")
            try:
                data = data[os.write(fd, data) :]
            except BlockingIOError:
                continue
            except OSError:
                raise CaseFailed("the program ended") from None

    def ask(self, request: dict[str, Any]) -> Any:
        nonce = secrets.token_hex(16)
        self.send((json.dumps({**request, "nonce": nonce}) + "\n").encode())
        answer = self.read_line()
        if answer.get("nonce") != nonce:
            raise CaseFailed("an answer that does not belong to the request")
        if "error" in answer:
            raise rebuild_error(answer["error"])
        if "h" in answer:
            return Remote(self, ("handle", int(answer["h"])))
        try:
            return ast.literal_eval(str(answer["v"]))
        except (KeyError, ValueError, SyntaxError, MemoryError, RecursionError):
            raise CaseFailed("an answer that is not plain data") from None


UNRAISABLE = (StopIteration, StopAsyncIteration)
"""Exceptions that would end the assert's own loops (``all(map(f, xs))`` on an empty rest)."""


def rebuild_error(error: Any) -> Exception:
    """The program's exception as this process's built-in type with the same arguments; the
    sandbox's description is data, so only a built-in ``Exception`` type is rebuilt."""
    if not isinstance(error, dict):
        return RuntimeError(f"the program raised {str(error)[:1000]}")
    text = str(error.get("text", ""))[:1000]
    raised = RuntimeError(f"the program raised {str(error.get('name'))[:100]}: {text}")
    kind = getattr(builtins, str(error.get("type")), None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)) or issubclass(kind, UNRAISABLE):
        return raised
    try:
        args = ast.literal_eval(str(error["args"]))
        if type(args) is tuple:
            return kind(*args)
    except Exception:  # not plain data, or arguments the type refuses
        pass
    try:
        return kind(text)
    except Exception:
        return raised


def read_free_names(check: str) -> tuple[set[str], set[str]]:
    """The names the assert uses but does not bind (globals of its compiled code, in every
    nested scope), and those of them it calls directly (``name(...)``)."""
    table = symtable.symtable(check, "<test case>", "exec")
    bound: set[str] = set()
    used: set[str] = set()
    tables = [table]
    while tables:
        scope = tables.pop()
        tables += scope.get_children()
        for symbol in scope.get_symbols():
            name = symbol.get_name()
            top = scope is table
            if (top or symbol.is_global()) and (symbol.is_assigned() or symbol.is_imported()):
                bound.add(name)
            elif (top or symbol.is_global()) and symbol.is_referenced():
                used.add(name)
    called = {
        node.func.id
        for node in ast.walk(ast.parse(check))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    free = used - bound
    return free, free & called


def build_scope(
    check: str, program_names: list[str], session: Session, helpers: str = ""
) -> dict[str, Any]:
    """The assert's globals: builtins, the standard modules it names (never called: a module
    cannot be), the prompt's ``helpers`` (run here: trusted, like the assert), and proxies for
    the program's names among the rest of its free names. The helpers' names are bound by
    their own code, so they are never free and never reach the program."""
    free, called = read_free_names(f"{helpers}\n{check}")
    scope: dict[str, Any] = {"__builtins__": builtins}
    defined = set(program_names)
    for name in sorted(free):
        if hasattr(builtins, name):
            continue
        if name in sys.stdlib_module_names and name not in called:
            try:
                scope[name] = importlib.import_module(name)
                continue
            except ImportError:
                pass
        if name in defined:
            scope[name] = Remote(session, ("name", name))
    if helpers:
        exec(compile(helpers, "<helpers>", "exec", optimize=0), scope)
    return scope


def encode(value: Any) -> dict[str, Any]:
    if isinstance(value, Remote):
        if value._session is None or value._target[0] != "handle":
            raise TypeError("only objects the program returned can be passed back")
        return {"h": value._target[1]}
    return {"v": repr(value)}  # the sandbox reads it back with ast.literal_eval


class Remote:
    """A name or object of the program's, in the sandbox. Calls and attribute reads go there;
    truth tests and comparisons are refused, so only plain values returned can pass."""

    def __init__(self, session: Session, target: tuple[str, Any]) -> None:
        self._session, self._target = session, target

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request: dict[str, Any] = {"op": "call", "target": list(self._target)}
        request["args"] = [encode(a) for a in args]
        request["kwargs"] = {k: encode(v) for k, v in kwargs.items()}
        return self._session.ask(request)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return self._session.ask({"op": "getattr", "target": list(self._target), "attr": attr})

    def __bool__(self) -> bool:
        raise TypeError("a truth test on an object of the program's (not plain data)")

    def __eq__(self, other: object) -> bool:
        raise TypeError("a comparison with an object of the program's (not plain data)")

    __ne__ = __eq__
    __hash__ = None  # type: ignore[assignment]


def run_assert_case(program: str, check: str, limits: SandboxLimits, helpers: str = "") -> bool:
    """True when ``check`` runs to its end against the sandboxed program within the limits;
    ``helpers``: the prompt's functions the check calls (see :func:`build_scope`)."""
    try:
        # optimize=0 whatever the interpreter's -O or PYTHONOPTIMIZE: an optimised compile drops
        # the assert statements, and every program would pass.
        code = compile(check, "<test case>", "exec", optimize=0)
        compile(helpers, "<helpers>", "exec")
    except SyntaxError:
        return False
    with tempfile.TemporaryFile() as err:
        box = Sandbox(
            {"main.py": program, "helpers.py": helpers, "call_server.py": SERVER.read_text()},
            f"{WORK}/call_server.py",
            limits,
            subprocess.PIPE,
            subprocess.PIPE,
            err,
        )
        try:
            return run_check(Session(box), check, code, helpers)
        finally:
            box.close()
            for pipe in (box.proc.stdin, box.proc.stdout):
                close_quietly(pipe)


def run_check(session: Session, check: str, code: Any, helpers: str = "") -> bool:
    try:
        names = session.read_line().get("ready")
        if not isinstance(names, list):
            return False  # the program failed to load (or exited while loading)
        exec(code, build_scope(check, [str(n) for n in names], session, helpers))
    except Exception:  # CaseFailed, AssertionError, and whatever the assert raised
        return False
    return True


def close_quietly(pipe: IO[bytes] | None) -> None:
    if pipe is not None:
        try:
            pipe.close()
        except OSError:
            pass
