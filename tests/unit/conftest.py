"""The tests here start no process: each one that does (in its setup or its call) fails, naming
what it started. Tests that start processes live in ``tests/dist/``.

The check is an audit hook (:func:`sys.addaudithook`) on the events that start a process
(:data:`PROCESS_EVENTS`), plus ``multiprocessing``'s own starts (a forkserver's or a spawned
child is started by ``BaseProcess.start``, which has no audit event of its own). A process is
recorded, not refused: code that catches the error (the compiled update's fallback to eager
does) would hide a refusal.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import sys
from collections.abc import Generator, Iterator

import pytest

PROCESS_EVENTS = frozenset(
    ("subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system")
)
"""The audit events that start a process."""

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
    """The processes started inside the ``with`` block, one line each, as they start."""
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


def _fail_on_starts(item: pytest.Item, phase: str) -> Generator[None, object, object]:
    with process_starts() as started:
        result = yield
    if started:
        pytest.fail(
            f"{item.nodeid} starts processes in its {phase} ({'; '.join(started)}): a test "
            "that starts one belongs in tests/dist/"
        )
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _fail_on_starts(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _fail_on_starts(item, "call"))
