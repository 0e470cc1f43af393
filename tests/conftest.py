"""Where a test lives says what it is: ``tests/unit/`` starts no process (its conftest fails one
that does), ``tests/dist/`` does (gloo ranks through :func:`tests.helpers.run_ranks`,
subprocesses, notebook kernels, torchrun, Ray, the C++ compiler behind ``torch.compile``).

The tests of ``tests/dist/`` are also marked ``slow``, so that ``-m "not slow"`` keeps its old
meaning; ``make test-fast`` runs ``tests/unit`` and ``property_tests``. ``bench`` (a benchmark
end to end) is set by hand and runs only in ``make bench``.

Two fixtures serve the compile tests of both folders: ``fresh_caches`` and ``compiles``.

``make unit`` runs on three pytest-xdist workers; the modules with the longest tests go first
(:data:`LONGEST_FIRST`), so that no worker is left with a long test at the end. What collection
made is frozen (:func:`pytest_collection_finish`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import pytest
from torch import Tensor

import zero_functional.functional.compiled as compiled

DIST = Path(__file__).resolve().parent / "dist"
LONGEST_FIRST = (
    "test_link.py",
    "test_launchers.py",
    "test_ray.py",
    "test_elastic.py",
    "test_teardown.py",
    "test_launch.py",
    "test_train.py",
    "test_mesh.py",
    "test_reliability.py",
    "test_compiled.py",
    "test_notebooks.py",
    "test_muon_modes.py",
    "test_preemption.py",
    "test_lowbit.py",
    "test_readme.py",
    "test_optimizer.py",
    "test_checkpoint.py",
)
"""The modules of ``tests/dist/`` that hold the longest tests, by their longest (``--durations``
of ``tests/dist`` without xdist), in that order: the README's ``bench --link`` line and the
``train`` jobs of SLURM and Kubeflow first, each a minute or more on a loaded machine."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(DIST):
            item.add_marker(pytest.mark.slow)
    rank = {DIST / name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path, len(rank)))  # stable: the rest in order


def pytest_collection_finish(session: pytest.Session) -> None:
    """``gc.freeze()`` what collection made: torch, the package, every test module and item,
    alive to the end of the session. A full collection then walks only what the tests make
    (tests/unit and property_tests: 27 full passes over 485,000 objects took 5.6 s of 43 s of
    CPU), and a rank forked from this process does not copy them when it collects. What a test
    makes is collected as before: a frozen object is never garbage here, and one it refers to
    still counts as referenced."""
    gc.freeze()


@pytest.fixture
def fresh_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget compiled graphs and failures, so a test sees its own."""
    monkeypatch.setattr(compiled, "_GRAPHS", {})
    monkeypatch.setattr(compiled, "_FAILED", {})


@pytest.fixture
def compiles(fresh_caches: None, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The graphs the test asks to compile, by name; none is compiled (each fails)."""
    asked: list[str] = []

    def record(fn: Callable[..., list[Tensor]]) -> Callable[..., list[Tensor]]:
        asked.append(fn.__name__)
        raise RuntimeError("not compiled in this test")

    monkeypatch.setattr(compiled, "_compile", record)
    return asked
