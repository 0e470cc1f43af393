"""Markers for the test run: ``slow`` (starts processes) on every test of a module that does.

A module that starts ranks, subprocesses or notebook kernels is marked as a whole, so that a new
multi-process test cannot forget its marker; ``make test-fast`` deselects them
(``-m "not slow and not bench"``). ``bench`` (a benchmark run end to end) is set by hand and
runs in ``make bench`` only.
"""

from __future__ import annotations

import pytest

STARTS_PROCESSES = ("run_ranks(", "subprocess", "mp.spawn(", "NotebookClient(")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen: dict[str, bool] = {}
    for item in items:
        path = str(item.path)
        if path not in seen:
            text = item.path.read_text() if item.path.suffix == ".py" else ""
            seen[path] = any(marker in text for marker in STARTS_PROCESSES)
        if seen[path]:
            item.add_marker(pytest.mark.slow)
