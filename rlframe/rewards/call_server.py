"""Inside the sandbox (standard library only): load the program, then answer calls on it.

``code_tests`` runs a row's asserts *outside* the sandbox, in the reward worker, against
proxies of the program's names. Each call or attribute read a proxy makes arrives here as
one JSON line on fd 0; the answer goes back as one JSON line on fd 1: the result as the
``repr`` of plain data (numbers, strings, bytes, None and lists, tuples, sets and dicts of
them, exact types only), or a handle for anything else, or the exception raised: its
nearest built-in type, the ``repr`` of its arguments when they are plain, and its text. Each
request carries a nonce the answer must echo, so answers written before a request cannot
match it. The program's own stdin is empty and its prints go to stderr: it never sees the
asserts or their expected values, and nothing it does here can make an assert pass except
returning the right plain values. The prompt's helpers (``/sandbox/helpers.py``, empty
without any) run in the program's namespace before it loads and again after, so the program
can call them; the asserts never use these copies, but the reward worker's own.
"""

from __future__ import annotations

import builtins
import importlib.util
import json
import math
import os
import sys

# Not `from typing import TYPE_CHECKING`: the server imports nothing it does not use.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

PLAIN_SCALARS = (int, float, complex, str, bytes, bool, type(None))
PLAIN_CONTAINERS = (list, tuple, set, frozenset)
# Taken before the program loads: it may replace names in builtins.
BUILTIN_EXCEPTIONS = {
    id(kind): name
    for name, kind in vars(builtins).items()
    if isinstance(kind, type) and issubclass(kind, BaseException)
}


def is_plain(value: Any, depth: int = 0) -> bool:
    """Exact built-in data whose repr reads back with ast.literal_eval (no subclasses:
    an int subclass could redefine __eq__)."""
    kind = type(value)
    if depth > 50:
        return False
    if kind in PLAIN_SCALARS:
        return kind is not float or math.isfinite(value)
    if kind in PLAIN_CONTAINERS:
        return all(is_plain(v, depth + 1) for v in value)
    if kind is dict:
        return all(is_plain(k, depth + 1) and is_plain(v, depth + 1) for k, v in value.items())
    return False


def main() -> None:
    requests = os.fdopen(os.dup(0), "r")
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)
    sys.stdin, sys.stdout = open(0), open(1, "w", buffering=1)
    spec = importlib.util.spec_from_file_location("solution", "/sandbox/main.py")
    if spec is None or spec.loader is None:
        answers.write(json.dumps({"load_error": "ImportError: /sandbox/main.py"}) + "\n")
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["solution"] = module
    with open("/sandbox/helpers.py") as f:
        helpers = compile(f.read(), "/sandbox/helpers.py", "exec")
    try:
        # The prompt's helpers, before the program (it may call them as it loads, without a
        # copy of its own) and again after it, over whatever the program bound to their names.
        exec(helpers, vars(module))
        spec.loader.exec_module(module)
        exec(helpers, vars(module))
    except BaseException as e:  # SystemExit too: the program ended before any call
        answers.write(json.dumps({"load_error": f"{type(e).__name__}: {e}"}) + "\n")
        return
    names = [n for n in vars(module) if not n.startswith("__")]
    answers.write(json.dumps({"ready": names}) + "\n")
    handles: dict[int, Any] = {}
    for line in requests:
        request = json.loads(line)
        answer: dict[str, Any] = {"nonce": request["nonce"]}
        try:
            answer.update(serve(request, module, handles))
        except BaseException as e:
            answer["error"] = describe_error(e)
        answers.write(json.dumps(answer) + "\n")


def describe_error(error: BaseException) -> dict[str, Any]:
    """The exception as data: the first built-in type in its class's MRO, its arguments."""
    kind = next(
        (BUILTIN_EXCEPTIONS[id(k)] for k in type(error).__mro__ if id(k) in BUILTIN_EXCEPTIONS),
        "BaseException",
    )
    try:
        text = str(error)[:1000]
        args = repr(error.args) if is_plain(error.args) else None
    except BaseException:
        text, args = "(an error whose text cannot be read)", None
    return {"type": kind, "name": type(error).__name__, "args": args, "text": text}


def serve(request: dict[str, Any], module: Any, handles: dict[int, Any]) -> dict[str, Any]:
    import ast

    def decode(arg: dict[str, Any]) -> Any:
        return handles[arg["h"]] if "h" in arg else ast.literal_eval(arg["v"])

    kind, ref = request["target"]
    target = getattr(module, ref) if kind == "name" else handles[ref]
    if request["op"] == "getattr":
        result = getattr(target, request["attr"])
    else:
        args = [decode(a) for a in request["args"]]
        kwargs = {k: decode(v) for k, v in request["kwargs"].items()}
        result = target(*args, **kwargs)
    if is_plain(result):
        return {"v": repr(result)}
    handles[len(handles)] = result
    return {"h": len(handles) - 1}


main()
