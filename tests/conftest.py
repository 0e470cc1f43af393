"""Markers for the test run: ``slow`` on each test that starts processes, and a check that no
other test does.

A test is ``slow`` when the source of what it can reach contains one of
:data:`STARTS_PROCESSES` (or, in the tests' own code, :data:`COMPILES`): its own function (decorators, nested functions and its class
included), the fixtures it requests, and, transitively, every function or class its source
names that is defined in ``tests/`` or ``property_tests/``, and every plain function (not a
method: which one runs is not known from the text) that is defined in ``src/`` or
``benchmarks/``. So a test that calls ``cli.main(["train", ...])`` is slow, since ``main``
reaches ``launch.run_ranks``; a pure test beside multi-process ones in its module is not.
``make test-fast`` deselects the slow ones (``-m "not slow and not bench"``). ``bench`` (a
benchmark run end to end) is set by hand and runs in ``make bench`` only.

What the text cannot show (a method that starts processes, a name built at run time) the run
does: a test that is not ``slow`` and starts a process anyway fails, naming what it started
(:func:`pytest_runtest_call`, for ``tests/``; ``property_tests/`` start none), so a rule that
misses one is seen at its first run.

``make test`` runs the tests on two pytest-xdist workers; the modules with the longest tests go
first (:data:`LONGEST_FIRST`), so that neither worker is left with a long test at the end.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import multiprocessing.process
import sys
import textwrap
import types
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
STARTS_PROCESSES = (
    "run_ranks(",
    "run_script(",
    "subprocess",
    "mp.spawn(",
    "start_processes(",
    "Popen(",
    "os.fork(",
    ".Process(",
    "NotebookClient(",
    "ray.init(",
)
"""Text in a reachable function that marks its tests ``slow``."""
COMPILES = ("torch.compile(", "compile=True", "compiled_adam_update_", "compiled_sgd_update_")
"""Text in a reachable function of the tests that marks its tests ``slow``: inductor runs the
C++ compiler (and a pool of workers) as processes. Only in the tests: whether ``src`` compiles is
decided when it runs (``compile=`` and the compile policy), not by what its text reaches."""
TEST_DIRS = (ROOT / "tests", ROOT / "property_tests")
"""Where functions and classes are followed whole."""
CODE_DIRS = (ROOT / "src", ROOT / "benchmarks")
"""Where plain functions are followed (methods are not)."""
LONGEST_FIRST = (
    "test_teardown.py",
    "test_notebooks.py",
    "test_readme.py",
    "test_mesh.py",
    "test_train.py",
)
"""The modules that hold the longest tests (measured with ``--durations``), in that order."""
PROCESS_EVENTS = frozenset(
    ("subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system")
)
"""The audit events (:func:`sys.addaudithook`) that start a process."""


@functools.cache
def _in(file: str, dirs: tuple[Path, ...]) -> bool:
    return any(Path(file).resolve().is_relative_to(d) for d in dirs)


def _defined_in(obj: Callable[..., Any] | type, dirs: tuple[Path, ...]) -> bool:
    if isinstance(obj, types.FunctionType):
        return _in(obj.__code__.co_filename, dirs)
    file = getattr(sys.modules.get(obj.__module__), "__file__", None)
    return file is not None and _in(file, dirs)


def _followed(obj: object, depth: int = 0) -> Iterator[Callable[..., Any] | type]:
    """The functions and classes in ``obj`` (a value a name resolves to) whose source is read."""
    if isinstance(obj, functools.partial):
        yield from _followed(obj.func, depth)
        for arg in (*obj.args, *obj.keywords.values()):
            yield from _followed(arg, depth + 1)
    elif isinstance(obj, dict) and depth < 2:  # a table of workers, cases, commands
        for value in obj.values():
            yield from _followed(value, depth + 1)
    elif isinstance(obj, list | tuple | set | frozenset) and depth < 2:
        for value in obj:
            yield from _followed(value, depth + 1)
    elif isinstance(obj, types.FunctionType | type):
        fn = inspect.unwrap(obj) if isinstance(obj, types.FunctionType) else obj
        plain = isinstance(fn, types.FunctionType) and fn.__qualname__ == fn.__name__
        if _defined_in(fn, TEST_DIRS) or (plain and _defined_in(fn, CODE_DIRS)):
            yield fn
    else:  # a @pytest.fixture named in a test's source, or another wrapper of a function
        wrapped = inspect.getattr_static(obj, "__wrapped__", None)
        if isinstance(wrapped, types.FunctionType):
            yield from _followed(wrapped, depth)


def _resolve(node: ast.expr, scope: dict[str, Any]) -> Iterator[object]:
    """What a name or a dotted name (``comm.all_reduce``) and each of its prefixes resolve to."""
    if isinstance(node, ast.Name):
        if node.id in scope:
            yield scope[node.id]
    elif isinstance(node, ast.Attribute):
        for base in _resolve(node.value, scope):
            yield base
            if isinstance(base, types.ModuleType | type) and hasattr(base, node.attr):
                yield getattr(base, node.attr)


@functools.cache
def _read(obj: Callable[..., Any] | type) -> tuple[bool, tuple[Callable[..., Any] | type, ...]]:
    """Whether ``obj``'s own source starts processes, and what its source names that is followed."""
    try:
        source = textwrap.dedent(inspect.getsource(obj))
    except OSError:  # no source to read (made by exec): what it runs is left to the run's check
        return False, ()
    markers = STARTS_PROCESSES + COMPILES if _defined_in(obj, TEST_DIRS) else STARTS_PROCESSES
    if any(marker in source for marker in markers):
        return True, ()
    scope = dict(vars(sys.modules[obj.__module__]))
    named: list[Callable[..., Any] | type] = []
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a lambda's line, cut out of a longer expression: its text was read
        return False, ()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name | ast.Attribute):
            for value in _resolve(node, scope):
                named.extend(f for f in _followed(value) if f is not obj)
    return False, tuple(dict.fromkeys(named))


def starts_processes(roots: Iterable[object]) -> bool:
    """Whether any of ``roots`` (a test function, its class, its fixtures' functions) reaches a
    function whose source holds one of :data:`STARTS_PROCESSES`, as the module docstring says."""
    todo = [f for root in roots for f in _followed(root)]
    seen: set[object] = set()
    while todo:
        obj = todo.pop()
        if obj in seen:
            continue
        seen.add(obj)
        marked, named = _read(obj)
        if marked:
            return True
        todo.extend(named)
    return False


def _roots(item: pytest.Item) -> list[object]:
    """The test's function, its class, its fixtures' functions and its parameters."""
    roots: list[object] = [getattr(item, "function", None), getattr(item, "cls", None)]
    info = getattr(item, "_fixtureinfo", None)  # what pytest itself reads
    if info is not None:
        for name in item.fixturenames:  # type: ignore[attr-defined]
            roots.extend(fixturedef.func for fixturedef in info.name2fixturedefs.get(name, ()))
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        roots.extend(callspec.params.values())
    return [r for r in roots if r is not None]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.suffix != ".py" or starts_processes(_roots(item)):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest in order


_started: list[list[str]] = []
"""Where :func:`process_starts` records, while it is open (innermost last)."""


def _audit(event: str, args: tuple[object, ...]) -> None:
    if _started and event in PROCESS_EVENTS and not _finding_a_library():
        _started[-1].append(f"{event} {args[:2]!r}")


def _finding_a_library() -> bool:
    """Whether ``ctypes.util.find_library`` is running (it asks ``ldconfig -p``, or ``gcc``,
    where a shared library is, in milliseconds: ``atomic_dir`` finds libc so)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__") == "ctypes.util":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


sys.addaudithook(_audit)  # cannot be removed: it records only while process_starts is open


@contextlib.contextmanager
def process_starts() -> Iterator[list[str]]:
    """The processes started inside the ``with`` block, one line each, as they start: the
    audited starts (:data:`PROCESS_EVENTS`) and ``multiprocessing``'s (a forkserver's or a
    spawned child is started by ``BaseProcess.start``, which has no audit event of its own)."""
    start = multiprocessing.process.BaseProcess.start

    def recorded_start(process: multiprocessing.process.BaseProcess) -> None:
        if _started:
            _started[-1].append(f"multiprocessing {process.name}")
        start(process)

    started: list[str] = []
    _started.append(started)
    multiprocessing.process.BaseProcess.start = recorded_start  # type: ignore[method-assign]
    try:
        yield started
    finally:
        multiprocessing.process.BaseProcess.start = start  # type: ignore[method-assign]
        _started.pop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    """Run a test that is not ``slow`` inside :func:`process_starts`; fail it if it started a
    process (recorded, not refused: code that catches the error, as the compiled update's
    fallback to eager does, would hide a refusal)."""
    if item.get_closest_marker("slow") is not None:
        return (yield)
    with process_starts() as started:
        result = yield
    if started:
        pytest.fail(
            f"{item.nodeid} starts processes ({'; '.join(started)}) but is not marked slow: "
            "name what starts them in the test or in a function it calls (tests/conftest.py "
            "says how the marker is found), so that make test-fast leaves it out"
        )
    return result
