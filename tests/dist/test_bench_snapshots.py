"""``benchmarks/bench_snapshots.py`` end to end, quickly: its tables and the exact command (never
its times), and the share's bytes against the optimizer state it holds."""

from __future__ import annotations

import re

import pytest

from tests.helpers import run_script


@pytest.mark.bench  # the benchmark end to end (about 40 s on 2 cores): make bench runs it
def test_bench_snapshots_reports_the_cost_and_a_share_of_state_plus_values() -> None:
    argv = ["--world-sizes", "2", "--rounds", "1", "--iterations", "3", "--models", "mlp"]
    proc = run_script("benchmarks/bench_snapshots.py", *argv, "--numel", "524288", "--no-recovery")
    out = proc.stdout
    assert proc.returncode == 0, (out[-3000:], proc.stderr[-3000:])
    assert out.startswith("$ PYTHONPATH=")  # the exact command first
    for row in ("iteration, no snapshot", "snapshot() returns, none in flight"):
        assert re.search(rf"\n{re.escape(row)} +[\d.]+ +[\d.]+x", out), out
    assert "issue 43: snapshot() returns, every step" in out
    taken, calls = map(int, re.search(r"every step: (\d+) of (\d+) calls taken", out).groups())
    assert calls == 3 and 1 <= taken <= 3, out  # the first call finds the threads free
    # 2 x Linear(512, 512) at 2 ranks: each share holds half the Adam state and half the values
    share, copy, _, state = (
        float(v) for v in re.search(r"rank 0 +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+)", out).groups()
    )
    assert state == pytest.approx(2.0, abs=0.02)  # 2 x 2 x 512 x 513 x 4 B / 2 ranks, MiB
    assert share == pytest.approx(1.5 * state, rel=0.05)  # + its pieces' fp32 values
    assert copy == pytest.approx(share, rel=0.05)
