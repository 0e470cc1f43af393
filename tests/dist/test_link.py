"""``--link RATE`` (issue 33): benchmarks re-run on a shaped loopback of a private network
namespace, say so first, show each row's byte floor; where that is not allowed, one line and
exit 2. No timing is asserted here (speed belongs in benchmarks/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zero_functional.app.link import shaped_command

from tests.helpers import ROOT


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), **extra}


def _shaping_allowed() -> str:
    """Why shaping is not allowed here, or ``""``."""
    try:
        probe = subprocess.run(
            shaped_command("1gbit", ["true"]), capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return "" if probe.returncode == 0 else probe.stderr.strip()[-200:]


def test_without_namespaces_one_line_says_why_and_the_exit_is_2(tmp_path: Path) -> None:
    # no unshare, ip or tc on PATH: nothing runs, one line on stderr, status 2
    r = subprocess.run(
        [sys.executable, "-m", "zero_functional", "bench", "--link", "2gbit"],
        capture_output=True,
        text=True,
        env=_env(PATH=str(tmp_path)),
        timeout=60,
    )
    assert r.returncode == 2, r
    assert r.stderr.strip() == (
        "--link 2gbit: cannot shape a private loopback here (unshare, ip, tc not found)"
    )
    assert r.stdout == ""


def test_bench_collectives_on_a_shaped_link_says_so_and_shows_byte_floors(tmp_path: Path) -> None:
    why = _shaping_allowed()
    if why:
        pytest.skip(f"network namespaces are not allowed here: {why}")
    out = tmp_path / "rows.json"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_collectives.py"),
            "--link",
            "1gbit",
            "--world-sizes",
            "2",
            "--rounds",
            "1",
            "--numel",
            "250000",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    first = r.stdout.splitlines()[0]
    assert first.startswith("link: 1gbit (1 Gbit/s), the loopback of a private network namespace")
    rows = {row["variant"]: row for row in json.loads(out.read_text())}
    numel = 1000 * 1000 + 1000  # --numel under 1e6 still builds one Linear(1000, 1000)
    # 2 ranks: a reduce onto owners moves (N - 1) S in all; an all-reduce twice that;
    # torch's all-reduce + broadcast three times
    reduce_floor = numel * 4 * 8 / 1e9 * 1e3
    assert rows["ours: reduce onto owners"]["floor_ms"] == pytest.approx(reduce_floor)
    assert rows["DDP: all-reduce"]["floor_ms"] == pytest.approx(2 * reduce_floor)
    assert rows["torch's ZeRO: all-reduce + broadcast per owner"]["floor_ms"] == pytest.approx(
        3 * reduce_floor
    )
    assert all(row["vs_floor"] > 0 for row in rows.values())


@pytest.mark.bench  # 40 s of CPU, 80 s on a loaded machine: make bench runs it
def test_the_readmes_bench_link_line_runs_to_the_end() -> None:
    """The README's ``zero-functional bench --link ...`` example, to its summary table, says its
    link first and shows the byte floors (``make bench``, as the README's ``bench --quick``; the
    shaped link itself is in ``make test``: the tests above and below)."""
    from tests.dist.test_readme import run_in_subprocess
    from tests.unit.test_readme import cli_commands

    lines = [argv for argv in cli_commands("bench") if "--link" in argv]
    assert lines, "the README shows no `zero-functional bench --link` line"
    why = _shaping_allowed()
    if why:
        pytest.skip(f"network namespaces are not allowed here: {why}")
    for argv in lines:
        proc = run_in_subprocess(argv)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rate = argv[argv.index("--link") + 1]
        assert proc.stdout.startswith(f"link: {rate} "), proc.stdout[:300]
        assert "x floor" in proc.stdout and "== summary" in proc.stdout
