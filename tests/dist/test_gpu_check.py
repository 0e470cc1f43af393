"""benchmarks/gpu_check.py, the prepared GPU/NCCL check, on its CPU stand-in (``--cpu --quick``).

The script is run for real only on a machine with a GPU; this keeps its logic working here: every
part (modes at 1 and 2 gloo ranks, the 2-rank probe, timings, compiled kernels) passes or skips
with a stated reason, and the summary is written. About 30-50 s on 2 cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_script

# a benchmark script end to end (about a minute on 2 cores): `make bench` runs it
pytestmark = pytest.mark.bench


def test_gpu_check_passes_or_skips_every_part_on_cpu(tmp_path: Path) -> None:
    proc = run_script("benchmarks/gpu_check.py", "--cpu", "--quick", "--out", str(tmp_path))
    out = proc.stdout
    failed = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert proc.returncode == 0 and not failed, (failed, out[-4000:], proc.stderr[-2000:])
    assert "RESULT: " in out and " 0 FAIL" in out
    md = (tmp_path / "gpu_check.md").read_text()
    for row in (
        "| after-backward sorted_greedy AdamW | PASS | PASS |",
        "| overlap interleaved flat SGD, 1 bucket/param | PASS | PASS |",
        "| checkpoint save flat, load sorted_greedy | PASS | PASS |",
        "| comm paths (coalesced, padded, twin group, scalars) | PASS | PASS |",
    ):
        assert row in md, (row, md[:3000])
    assert "| AdamW | ours adamw_update_ default (fused) |" in md
    skipped = [line for line in out.splitlines() if line.startswith("SKIP")]
    assert all(": " in line and line.split(": ", 1)[1].strip() for line in skipped), skipped
    for name in ("gpu_check.json", "gpu_check.log", "gpu_check_ranks.log"):
        assert (tmp_path / name).stat().st_size > 0, name
