"""Mutation testing of the pure modules against their unit tests; prints the kill rate per module.

    nice -n 15 python bench/mutation.py                      # every module below
    nice -n 15 python bench/mutation.py algorithms checkpoint  # some of them
    nice -n 15 python bench/mutation.py --list                 # the modules and their tests

A small AST mutator (no third-party tool): each mutant changes one operator, comparison,
boolean, constant, condition or call statement of one source file, the way a reviewer's slip
would. For each mutant the module's unit tests run (``pytest -x``) in a forked child of a
process that has already imported torch and pytest, against a copy of the tree holding the
mutant, so a mutant costs the tests' own time plus about a second. A mutant is *killed* when a
test fails, errors or runs past its time limit (``--timeout-factor`` times the clean run, at
least 10 s); it *survives* when the tests pass. Survivors are printed with file, line, and
the change, so that each gets a test or is listed as equivalent (``EQUIVALENT`` below).

It is not part of CI (minutes per module on two cores). Run it before merging a change to
one of these modules, and read the survivors.
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODULES: dict[str, tuple[list[str], list[str]]] = {
    "algorithms": (
        [
            "rlframe/algorithms/advantages.py",
            "rlframe/algorithms/losses.py",
            "rlframe/algorithms/mismatch.py",
            "rlframe/algorithms/policy_objective.py",
        ],
        [
            "tests/unit/test_algorithms.py",
            "tests/unit/test_policy_objective.py",
            "tests/unit/test_algorithm_family.py",
            "tests/unit/test_algorithm_fixes.py",
            "tests/unit/test_kl_control.py",
            "tests/unit/test_caught_bugs.py",
        ],
    ),
    "sequence_layout": (
        ["rlframe/core/sequence_layout.py"],
        ["tests/unit/test_sequence_layout.py", "tests/unit/test_observation_gradient.py"],
    ),
    "multi_turn": (
        ["rlframe/rollout/multi_turn.py"],
        [
            "tests/unit/test_multi_turn.py",
            "tests/unit/test_multi_turn_budget.py",
            "tests/unit/test_multi_turn_rows.py",
        ],
    ),
    "tools": (
        ["rlframe/envs/tools.py", "rlframe/envs/tool_parsers.py"],
        ["tests/unit/test_envs.py", "tests/unit/test_tool_errors.py"],
    ),
    "chat": (
        ["rlframe/envs/chat.py"],
        [
            "tests/unit/test_envs.py",
            "tests/unit/test_multi_turn.py",
            "tests/unit/test_chat_suffix.py",
        ],
    ),
    "reward_pool": (
        ["rlframe/rewards/pool.py"],
        [
            "tests/unit/test_reward_scoring.py",
            "tests/unit/test_reward_pool_recovery.py",
            "tests/unit/test_reward_pool_hygiene.py",
            # The one sandbox test that kills a worker holding a sandbox (its cgroups).
            "tests/unit/test_sandbox.py::test_a_killed_reward_worker_takes_its_sandbox_with_it",
        ],
    ),
    "sandbox": (
        ["rlframe/rewards/sandbox.py", "rlframe/rewards/sandbox_command.py"],
        [
            "tests/unit/test_sandbox.py",
            "tests/unit/test_sandbox_limits.py",
            "tests/unit/test_sandbox_hygiene.py",
        ],
    ),
    "code_tests": (
        ["rlframe/rewards/code_tests.py"],
        ["tests/unit/test_math_code_rewards.py", "tests/unit/test_reward_hacks.py"],
    ),
    "checkpoint": (
        ["rlframe/state/checkpoint.py"],
        ["tests/unit/test_long_runs.py", "tests/unit/test_checkpoint_fallbacks.py"],
    ),
    "validation": (
        ["rlframe/loop/validation.py"],
        ["tests/unit/test_long_runs.py", "tests/unit/test_validation_split.py"],
    ),
}
"""Module -> (its source files, the unit tests run against each mutant: files, or
``file::test`` node ids). Tests whose file does not exist are skipped."""

EQUIVALENT: dict[str, str] = {
    "rlframe/algorithms/losses.py:107:0.0 -> 1.0": "gspo's clip_ratio_c=0 turns dual-clip off; "
    "1.0 turns it off too (dual-clip needs c > 1)",
    "rlframe/loop/validation.py:22:1000003 -> 1000004": "any offset gives validation its own seed "
    "stream; the tests pin the offset's use, not its value",
    "rlframe/loop/validation.py:30:- -> +": "the early return only skips comb(n - c, k) = 0; "
    "without it the formula gives the same 1.0",
    "rlframe/loop/validation.py:30:a - b -> a": "as above: n < k never holds (checked just "
    "before), and the formula covers n - c < k",
    "rlframe/rewards/pool.py:94:0 -> 1": "RewardPool.restarts is a counter nothing reads",
    "rlframe/rewards/pool.py:116:drop augmented assignment": "RewardPool.restarts is a counter "
    "nothing reads",
    "rlframe/rewards/pool.py:116:1 -> 2": "RewardPool.restarts is a counter nothing reads",
    "rlframe/state/checkpoint.py:216:True -> False": "flush of a console line: only its order "
    "among other output changes",
    "rlframe/state/checkpoint.py:230:drop call statement": "fsync of the checkpoints folder after "
    "the rename: only a power loss tells it apart",
    "rlframe/rewards/sandbox_command.py:56:True -> False": "SandboxLimits frozen: nothing "
    "assigns to a limits object, so a mutable one behaves the same",
    "rlframe/rewards/sandbox.py:68:True -> False": "Isolation frozen: nothing assigns to it",
    "rlframe/rewards/sandbox.py:294:30 -> 31": "time limit of the isolation probe, which "
    "answers in milliseconds",
    "rlframe/rewards/sandbox.py:62:30.0 -> 60.0": "limit on building a sandbox (about 50 ms "
    "here): a test would need a build that hangs for 30 s",
    "rlframe/rewards/sandbox.py:196:drop call statement": "the ready byte is read only to be "
    "dropped: the pipe is closed right after, read or not",
    "rlframe/rewards/sandbox.py:200:- -> +": "the time given to a sandbox that took "
    "STARTUP_LIMIT_S (30 s) to build: a test would need a build that hangs that long",
    "rlframe/rewards/sandbox.py:213:False -> True": "the OOM flag of a sandbox without a "
    "memory cgroup: this machine always has one, which overwrites the flag",
    "rlframe/rewards/sandbox_command.py:108:negate condition": "chmod 0711 of the folders above "
    "the interpreter's prefix: bubblewrap 0.8 here already leaves them unlistable and passable "
    "for nobody (tests/unit/test_sandbox_hygiene.py checks that they are)",
    "rlframe/rewards/sandbox_command.py:108:!= -> ==": "as above: the chmod loop does not run",
    "rlframe/rewards/pool.py:29:120.0 -> 240.0": "limit on a worker's start-up: a test would "
    "wait 120 s for a worker that never starts",
    "rlframe/rewards/pool.py:41:0 -> 1": "bufsize of the worker's pipes: frames are read and "
    "written on the file descriptors, never through the file objects' buffers",
    "rlframe/rewards/pool.py:44:and -> or": "an assert of two facts that always hold "
    "(both pipes were asked for)",
    "rlframe/rewards/pool.py:108:> -> >=": "equality of two monotonic float times",
    "rlframe/rewards/pool.py:146:>= -> >": "equality of two monotonic float times",
    "rlframe/rewards/pool.py:205:>= -> >": "equality of two monotonic float times",
    "rlframe/rewards/pool.py:190:0 -> 1": "the worker that woke select is readable, so the "
    "wait returns at once whatever its limit",
    "rlframe/rewards/pool.py:191:drop continue": "a worker just moved from starting to ready "
    "is not busy: the next check skips it the same way",
    "rlframe/envs/chat.py:42:4096 -> 4097": "size of a memo cache",
    "rlframe/envs/chat.py:89:True -> False": "sort_keys of a memo key: the same observation "
    "dumps the same either way",
    "rlframe/envs/chat.py:98:False -> True": "the generation prompt follows the last "
    "end-of-turn token, and the suffix is cut at the last one either way",
    "rlframe/envs/chat.py:100:< -> <=": "the end-of-turn token never starts the rendered "
    "turns (a user turn comes first), so rfind never returns 0",
    "rlframe/envs/chat.py:100:0 -> 1": "as above: rfind returns -1 or a position past 0",
    "rlframe/core/sequence_layout.py:109:drop unary -": "fill value of packed_at for padding "
    "slots, never read: selected tokens are response tokens, so always real",
    "rlframe/core/sequence_layout.py:109:1 -> 2": "as above: the fill value is never read",
    "rlframe/core/sequence_layout.py:196:0 -> 1": "the same starting load on every rank: the "
    "lightest rank is the same whatever the offset",
    "rlframe/rollout/multi_turn.py:235:1 -> 2": "call_envs' default turn -1 only means no "
    "turn (a reset): -2 means the same",
    "rlframe/envs/chat.py:132:drop break": "with every content empty each further pass "
    "renders the same ids, and the same error follows; the break only saves those passes",
    "rlframe/rewards/code_tests.py:93:drop call statement": "run_python probes the sandbox "
    "itself (detect_isolation is cached); the early call only moves the error before the test "
    "cases are parsed, on a machine without bubblewrap",
    "rlframe/state/checkpoint.py:145:drop call statement": "fsync of a folder: only a power loss "
    "tells it apart, which no test here can cause",
    "rlframe/state/checkpoint.py:152:drop call statement": "flush before fsync: closing the file "
    "flushes it before the rename anyway; only a power loss tells it apart",
}
"""``file:line:change`` of mutants that no test can kill on this machine, and why. Filled
from the survivors' review; they are excluded from the kill rate."""

SANDBOX_PROCESSES = 512
"""RLIMIT_NPROC of the test child: bounds what sandboxed programs can fork under a mutant."""

SWAP_COMPARE = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
SWAP_BINOP = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
}
SYMBOL = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.And: "and",
    ast.Or: "or",
}


@dataclass
class Mutant:
    path: str
    line: int
    change: str
    source: str

    @property
    def key(self) -> str:
        return f"{self.path}:{self.line}:{self.change}"


def skipped_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes no mutant touches: annotations, docstrings, messages (f-strings, raise
    arguments, asserts) and ``__all__``-style declarations."""
    skip: set[int] = set()

    def mark(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, (ast.AnnAssign, ast.arg)):
            mark(node.annotation)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            mark(node.returns)
            for deco in node.decorator_list:
                mark(deco)
        if isinstance(node, ast.JoinedStr):
            mark(node)
        if isinstance(node, ast.Raise):
            mark(node.exc)
        if isinstance(node, ast.Assert):
            mark(node.msg)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            mark(node)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            mark(node)
    return skip


def mutate_node(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """(description, replacement) for each mutation of this one node."""
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        op = type(node.ops[0])
        if op in SWAP_COMPARE:
            new = copy.copy(node)
            new.ops = [SWAP_COMPARE[op]()]
            yield f"{SYMBOL[op]} -> {SYMBOL[SWAP_COMPARE[op]]}", new
    elif isinstance(node, ast.BinOp) and type(node.op) in SWAP_BINOP:
        op = type(node.op)
        new = copy.copy(node)
        new.op = SWAP_BINOP[op]()
        yield f"{SYMBOL[op]} -> {SYMBOL[SWAP_BINOP[op]]}", new
        yield f"a {SYMBOL[op]} b -> a", node.left
    elif isinstance(node, ast.BoolOp):
        new = copy.copy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield f"{SYMBOL[type(node.op)]} -> {SYMBOL[type(new.op)]}", new
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        yield f"drop unary {'not' if isinstance(node.op, ast.Not) else '-'}", node.operand
    elif isinstance(node, ast.Constant) and not isinstance(node.value, str):
        value = node.value
        if isinstance(value, bool):
            yield f"{value} -> {not value}", ast.Constant(not value)
        elif isinstance(value, int):
            yield f"{value} -> {value + 1}", ast.Constant(value + 1)
        elif isinstance(value, float):
            changed = value * 2 if value else 1.0
            yield f"{value} -> {changed}", ast.Constant(changed)


def mutate_statement(node: ast.stmt) -> Iterator[tuple[str, ast.stmt]]:
    """Statement-level slips: a negated condition, a dropped call, a dropped branch body."""
    if isinstance(node, (ast.If, ast.While)):
        new = copy.copy(node)
        new.test = ast.UnaryOp(ast.Not(), node.test)
        yield "negate condition", new
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        yield "drop call statement", ast.Pass()
    if isinstance(node, ast.AugAssign):
        yield "drop augmented assignment", ast.Pass()
    if isinstance(node, (ast.Continue, ast.Break)):
        yield f"drop {type(node).__name__.lower()}", ast.Pass()


class Locator(ast.NodeTransformer):
    """Walks the mutation points in order; replaces the ``target``-th one with its ``which``-th
    mutation (``target=-1``: replaces nothing, records how many mutations each point has)."""

    def __init__(self, target: int, which: int, skip: set[int]) -> None:
        self.target, self.which, self.skip = target, which, skip
        self.sizes: list[int] = []
        self.done: tuple[int, str] | None = None

    def visit(self, node: ast.AST) -> ast.AST | list[ast.stmt]:
        if id(node) in self.skip or self.done is not None:
            return node
        if isinstance(node, ast.stmt):
            options = list(mutate_statement(node))
        else:
            options = list(mutate_node(node))
        if options:
            if len(self.sizes) == self.target:
                change, replacement = options[self.which]
                self.done = (getattr(node, "lineno", 0), change)
                return ast.copy_location(replacement, node)
            self.sizes.append(len(options))
        return self.generic_visit(node)


def list_mutants(path: str) -> list[Mutant]:
    source = (ROOT / path).read_text()
    tree = ast.parse(source)
    counter = Locator(-1, 0, skipped_nodes(tree))
    counter.visit(tree)
    mutants: list[Mutant] = []
    for target, size in enumerate(counter.sizes):
        for which in range(size):
            tree = ast.parse(source)
            locator = Locator(target, which, skipped_nodes(tree))
            tree = locator.visit(tree)
            assert locator.done is not None
            ast.fix_missing_locations(tree)
            line, change = locator.done
            mutants.append(Mutant(path, line, change, ast.unparse(tree)))
    return mutants


def copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".venv", ".git", "outputs")
    for name in ("rlframe", "workers", "tests", "recipes"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    for name in ("pyproject.toml", "conftest.py"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, dest / name)


def run_tests(tree: Path, tests: list[str], timeout_s: float) -> tuple[bool, float]:
    """True when the tests pass (the mutant survives). Forked child; killed at the limit."""
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        # Sandboxed programs (uid nobody, no capabilities) inherit this: a mutant that turns
        # the sandbox's own process limit off must not let the fork-bomb test fork-bomb the
        # host. Root itself is not held by RLIMIT_NPROC.
        hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        cap = SANDBOX_PROCESSES if hard == resource.RLIM_INFINITY else min(hard, SANDBOX_PROCESSES)
        resource.setrlimit(resource.RLIMIT_NPROC, (cap, cap))
        os.chdir(tree)
        sys.path.insert(0, str(tree))
        import pytest

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        code = pytest.main(["-x", "-q", "-p", "no:cacheprovider", "-m", "not gpu", *tests])
        os._exit(int(code))
    deadline = start + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0, time.monotonic() - start
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return False, time.monotonic() - start
        time.sleep(0.05)


def run_module(name: str, tree: Path, args: argparse.Namespace) -> tuple[int, int, list[Mutant]]:
    sources, tests = MODULES[name]
    tests = [t for t in tests if (ROOT / t.split("::")[0]).exists()]
    passed, clean_s = run_tests(tree, tests, 900)
    if not passed:
        raise RuntimeError(f"{name}: skipped, its unit tests fail on the unmutated code: {tests}")
    limit = max(10.0, args.timeout_factor * clean_s)
    mutants = [m for path in sources for m in list_mutants(path)]
    if args.sample and len(mutants) > args.sample:
        mutants = sorted(random.Random(args.seed).sample(mutants, args.sample), key=lambda m: m.key)
    mutants = [m for m in mutants if m.key not in EQUIVALENT]
    survivors = []
    print(f"{name}: {len(mutants)} mutants, tests {clean_s:.1f} s clean", flush=True)
    for i, mutant in enumerate(mutants):
        target = tree / mutant.path
        original = target.read_text()
        target.write_text(mutant.source)
        try:
            survived, _ = run_tests(tree, tests, limit)
        finally:
            target.write_text(original)
        if survived:
            survivors.append(mutant)
            print(f"  survived: {mutant.key}", flush=True)
        if args.verbose:
            print(f"  [{i + 1}/{len(mutants)}] {'SURVIVED' if survived else 'killed'} {mutant.key}")
    killed = len(mutants) - len(survivors)
    print(f"{name}: {killed}/{len(mutants)} killed", flush=True)
    return killed, len(mutants), survivors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"default: all of {', '.join(MODULES)}")
    parser.add_argument("--list", action="store_true", help="print modules and tests, run nothing")
    parser.add_argument("--sample", type=int, default=0, help="at most this many mutants a module")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-factor", type=float, default=3.0)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    names = args.modules or list(MODULES)
    for name in names:
        if name not in MODULES:
            raise SystemExit(f"unknown module {name!r}; choose from {', '.join(MODULES)}")
    if args.list:
        for name in names:
            sources, tests = MODULES[name]
            print(f"{name}: {' '.join(sources)}\n    tests: {' '.join(tests)}")
        return
    # Imported once here, inherited by every forked child: a mutant costs its tests only.
    sys.dont_write_bytecode = True
    import pytest  # noqa: F401
    import torch  # noqa: F401

    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    rows = []
    for name in names:
        # A fresh copy per module: tests added while an earlier module ran are picked up.
        with tempfile.TemporaryDirectory(prefix="rlframe-mutation-") as tmp:
            tree = Path(tmp)
            copy_tree(tree)
            os.environ["PYTHONPATH"] = str(tree)
            start = time.monotonic()
            try:
                killed, total, survivors = run_module(name, tree, args)
            except RuntimeError as e:
                print(e, flush=True)
                continue
            rows.append((name, killed, total, survivors, time.monotonic() - start))
    print("\n| module | mutants | killed | kill rate | time |")
    print("|---|---|---|---|---|")
    for name, killed, total, _, seconds in rows:
        rate = 100.0 * killed / total if total else 100.0
        print(f"| {name} | {total} | {killed} | {rate:.1f}% | {seconds / 60:.1f} min |")
    for name, _, _, survivors, _ in rows:
        for mutant in survivors:
            print(f"survivor {name}: {mutant.key}")


if __name__ == "__main__":
    main()
