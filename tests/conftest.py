"""Markers for the test run: ``slow`` (starts processes) on every test of a module that does.

A module that starts ranks, subprocesses or notebook kernels is marked as a whole, so that a new
multi-process test cannot forget its marker; ``make test-fast`` deselects them
(``-m "not slow and not bench"``). ``bench`` (a benchmark run end to end) is set by hand and
runs in ``make bench`` only.

``make test`` runs the tests on two pytest-xdist workers; the modules with the longest tests go
first (:data:`LONGEST_FIRST`), so that neither worker is left with a long test at the end.
"""

from __future__ import annotations

import pytest

STARTS_PROCESSES = ("run_ranks(", "run_script(", "subprocess", "mp.spawn(", "NotebookClient(")
LONGEST_FIRST = ("test_teardown.py", "test_notebooks.py", "test_mesh.py", "test_train.py")
"""The modules that hold the longest tests (measured with ``--durations``), in that order."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen: dict[str, bool] = {}
    for item in items:
        path = str(item.path)
        if path not in seen:
            text = item.path.read_text() if item.path.suffix == ".py" else ""
            seen[path] = any(marker in text for marker in STARTS_PROCESSES)
        if seen[path]:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest in order
