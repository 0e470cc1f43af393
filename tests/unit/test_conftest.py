"""tests/unit/conftest.py's audit: what it records; a test here carries no ``slow`` marker."""

from __future__ import annotations

import pytest

from tests.unit.conftest import process_starts


def test_a_test_here_is_not_marked_slow(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("slow") is None


def test_process_starts_records_nothing_where_no_process_starts() -> None:
    with process_starts() as started:
        sum(range(10))
    assert started == []
