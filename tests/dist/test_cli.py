"""The ``zero-functional`` command line where it starts processes: ``train`` at 2 ranks bitwise
equal to its reference, help and argument errors in a fresh interpreter without torch,
``bench --quick`` (``bench``); the rest runs in one process: ``tests/unit/test_cli.py``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from zero_functional.app import cli
from zero_functional.app.plan_format import format_bytes

from tests.helpers import forked_train_ranks, run_cli


@pytest.fixture(autouse=True)
def _forked_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The train job's ranks forked from the tests' forkserver (tests.helpers.forked_train_ranks)."""
    forked_train_ranks(monkeypatch)


TINY_TRAIN = ["train", "--nproc", "2", "--epochs", "1", "--hidden", "16", "--batch-size", "256"]


@pytest.mark.parametrize("main_params", [[], ["--main-params", "fp32"]], ids=["bf16", "fp32 main"])
def test_train_a_bf16_model_matches_its_reference_bitwise_at_2_ranks(
    main_params: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*TINY_TRAIN, "--no-progress", "--dtype", "bf16", *main_params]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert ("bf16 model, fp32 main params" if main_params else "bf16 model") in out
    assert out.splitlines()[-1].endswith("(seed 0): bitwise equal"), out
    # the reference's whole state: 4 B main weights (if any) + AdamW's 2 moments per element,
    # plus a 4-byte step per tensor (6 tensors, 1,482 elements)
    per_element = 4 + 2 * 4 if main_params else 2 * 2
    assert f"  {format_bytes(per_element * 1482 + 6 * 4)}  " in out.splitlines()[2]


@pytest.mark.bench  # a benchmark end to end (about two minutes): make bench runs it
def test_bench_quick_ends_with_one_table_against_torch_best(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(["bench", "--quick"], capsys)
    assert code == 0
    table = out.split("== summary")[1].splitlines()[2:]
    benchmarks = {line.split("  ")[0] for line in table}
    assert benchmarks == {
        "Adam kernel (2.0M fp32)",
        "SGD momentum kernel (2.0M fp32)",
        "checkpoint save",
        "checkpoint save, async",
        "collectives (2M fp32)",
        "compressed (7 x Linear(512, 512) MLP + Adam)",
        "iteration (2.0M MLP)",
        "main params (2M bf16 AdamW)",
        "muon iteration (GPT 0.22M width 48, 24 matrices)",
        "muon step (GPT 0.22M width 48, 24 matrices)",
        "muon step (24 matrices (width 48) only)",
        "muon step (mixed shapes only)",
        "phases (1.8M MLP)",
        "snapshots (7 x Linear(512, 512) MLP + Adam)",
        "step (2M Adam)",
    }, table
    for line in table:  # each benchmark's own torch baseline is 1.00x by construction
        if "torch zero best" in line or " torch best " in line or "torch's ZeRO:" in line:
            assert "1.00x" in line, line
    assert any("ours overlap flat" in line for line in table)


FAKE_BENCH = {
    "bench_alpha.py": (
        '"""Alpha: what it measures."""\nimport json, sys\nprint("ran alpha")\n'
        "row = dict(benchmark='alpha', world_size=2, variant='torch best', ms=1.0, vs_torch_best=1.0)"
        "\njson.dump([row], open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n"
    ),
    "bench_lowbit_compiled.py": '"""Compiles."""\nprint("ran compiled")\nraise SystemExit(3)\n',
}


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_bench_says_what_each_script_measures_before_it_starts_and_how_long_it_took(
    quick: bool, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 42: a silent ``bench --quick`` ran past 300 s. Now it states how many scripts it
    runs and about how long they take, what each measures before it starts and its time after,
    and leaves out the compiled benchmark (a full ``bench`` runs it)."""
    for name, text in FAKE_BENCH.items():
        (tmp_path / name).write_text(text)
    code, out, _ = run_cli(["bench", "--dir", str(tmp_path), *["--quick"] * quick], capfd)
    lines = out.splitlines()
    if quick:
        assert code == 0 and "ran compiled" not in out, out
        assert lines[0].startswith("-- left out by --quick: bench_lowbit_compiled.py (it compiles")
        assert lines[1] == f"-- bench --quick runs 1 of 2 scripts, {cli.QUICK_TAKES}"
        lines = lines[2:]
    else:
        assert code == 3 and "ran compiled" in out and "--quick" not in out, out
    assert lines[:2] == [
        f"== bench_alpha.py (1/{2 - quick}): Alpha: what it measures.",
        "ran alpha",
    ]
    assert re.fullmatch(r"-- bench_alpha\.py: \d+ s \(\d+ s in all\)", lines[2]), lines
    assert "alpha  " in out.split("== summary")[1]


def test_a_timeout_below_one_second_is_printed_as_it_was_given(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # one spawned rank cannot even import torch in 0.5 s: the launcher stops it and says so (a
    # rank forked from the tests' forkserver has torch and the digits already: it may finish)
    from zero_functional.app import launch, train

    monkeypatch.setattr(train, "run_ranks", launch.run_ranks)
    code, _, err = run_cli(
        ["train", "--nproc", "1", "--timeout", "0.5", "--no-progress", "--no-reference"], capsys
    )
    assert code == 1
    assert err.startswith("zero-functional train: rank 0 gave no result within 0.5 s;"), err


NO_TORCH_SCRIPT = """
import sys
from zero_functional.app.cli import main

for argv in (
    ["--help"],
    ["--version"],
    ["train", "--help"],
    ["plan", "--help"],
    ["frobnicate"],
    ["train", "--bogus"],
    ["train", "--lr", "nan"],
    ["train", "--nproc", "4", "--batch-size", "2"],
    ["train", "--overlap", "--impl", "torch"],
    ["plan", "gpt2-small", "--world-sizes", "0"],
    ["plan", "gpt2-small", "--world-sizes", "64", "12", "--shard-size", "8"],
    ["plan", "gpt2-small", "--world-sizes", "64", "--simulate", "0,64"],
):
    try:
        main(argv)
    except SystemExit:
        pass
print("torch imported:", "torch" in sys.modules)
"""


def test_help_and_argument_errors_answer_without_importing_torch() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "torch imported: False", proc.stdout


NEEDS_SCRIPT = """
import sys
from zero_functional.app.cli import main

for argv in (
    ["train", "--save-every", "5"],
    ["demo", "--grace-s", "5", "--epochs", "2"],
    ["train", "--dtype", "bf16", "--main-params", "fp32", "--impl", "torch"],
):
    print(main(argv))
print("torch imported:", "torch" in sys.modules)
"""


def test_a_flag_that_needs_another_is_refused_in_one_line_naming_it_before_torch_loads() -> None:
    # issue 42 item 7: `train --save-every 5` was refused after 17.7 s (torch imported first), in
    # internal names ("got 5 with checkpoint None"); `--grace-s` without --checkpoint ran
    proc = subprocess.run(
        [sys.executable, "-c", NEEDS_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["2", "2", "2", "torch imported: False"], proc.stdout
    assert proc.stderr.splitlines() == [
        "zero-functional train: error: --save-every needs --checkpoint: it saves there",
        "zero-functional demo: error: --grace-s needs --checkpoint: SIGTERM saves there, within "
        "S seconds",
        "zero-functional train: error: --main-params fp32 needs --impl zero_functional: torch's "
        "ZeroRedundancyOptimizer keeps no main copy",
    ], proc.stderr


def test_python_dash_m_help_exits_0() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "zero_functional", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "train" in proc.stdout, proc.stderr
