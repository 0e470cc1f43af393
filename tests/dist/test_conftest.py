"""The folders' rules (tests/conftest.py, tests/unit/conftest.py): a test in ``tests/unit/``
that starts a process fails, naming it; a test in ``tests/dist/`` is marked ``slow``."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.unit.conftest import process_starts


def test_a_test_here_is_marked_slow(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("slow") is not None


def test_process_starts_records_subprocesses_and_multiprocessing() -> None:
    with process_starts() as started:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert len(started) == 1 and started[0].startswith("subprocess.Popen"), started
    with process_starts() as started:
        child = multiprocessing.get_context("fork").Process(target=sum, args=([],))
        child.start()
        child.join()
    assert any(s.startswith("multiprocessing") for s in started), started


def test_a_unit_test_that_starts_a_process_fails_naming_it(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "from tests.unit.conftest import pytest_runtest_call, pytest_runtest_setup\n"
    )
    (tmp_path / "test_starts.py").write_text(
        "import subprocess, sys\n\n"
        "def test_pure():\n    assert sum(range(3)) == 3\n\n"
        "def test_starts():\n    subprocess.run([sys.executable, '-c', 'pass'], check=True)\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "."],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "1 failed, 1 passed" in run.stdout, run.stdout + run.stderr
    assert "test_starts.py::test_starts starts processes in its call (subprocess.Popen" in (
        run.stdout
    ), run.stdout
    assert "belongs in tests/dist/" in run.stdout, run.stdout
