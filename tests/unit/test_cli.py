"""The ``zero-functional`` command line in this process: plans, and every user error as one line
with exit 2 before anything starts (the commands that start ranks or an interpreter:
``tests/dist/test_cli.py``)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

import zero_functional
from zero_functional.app import cli, train
from zero_functional.app.plan_format import format_bytes

from tests.helpers import run_cli


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


needs_partition = pytest.mark.skipif(
    not _importable("zero_functional.core.partition"),
    reason="zero_functional.core.partition (another session's module) has not landed yet",
)


def huge_linear() -> nn.Module:
    """10 billion parameters: 40 GB in fp32 unless `plan` builds it on the meta device."""
    return nn.Linear(100_000, 100_000)


def not_a_module() -> int:
    return 3


def needs_arguments(width: int) -> nn.Module:
    return nn.Linear(width, width)


def raises_inside() -> nn.Module:
    raise RuntimeError("no weights here")


def plan_rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.split()[0].isdigit()]


@needs_partition
def test_plan_of_builtin_model_reports_both_partitions_at_each_world_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_cli(["plan", "gpt2-small", "--world-sizes", "2", "8", "64"], capsys)
    assert code == 0, err
    assert "124,439,808 parameters" in out
    rows = plan_rows(out)
    assert [(r[0], r[1]) for r in rows] == [
        (w, p) for w in ("2", "8", "64") for p in ("sorted-greedy", "flat")
    ]
    # the token embedding (38.6M) bounds sorted-greedy's max load once world_size > 3
    greedy_64 = rows[4]
    assert greedy_64[6] == "38,597,376"
    assert float(greedy_64[4]) == 1.0  # max equals the lower bound: greedy is optimal here


@needs_partition
def test_plan_of_module_function_builds_on_meta_device_so_costs_no_memory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_cli(
        ["plan", "tests.unit.test_cli:huge_linear", "--world-sizes", "4"], capsys
    )
    assert code == 0, err
    assert "2 tensors, 10,000,100,000 parameters" in out
    flat_row = plan_rows(out)[1]
    assert flat_row[1] == "flat" and flat_row[2] == "1.000"


@needs_partition
def test_plan_predicted_adam_bytes_match_zeros_formula_for_flat_partition(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(["plan", "bert-base", "--world-sizes", "8"], capsys)
    assert code == 0
    flat_row = plan_rows(out)[1]
    assert flat_row[-1] == "1.000"  # max/formula


def memory_rows(out: str) -> dict[tuple[str, str], list[str]]:
    """The bytes-per-rank table's rows by (world size, partition): params .. total cells."""
    table = out.split("bytes per rank (fullest rank)")[1]
    rows = [line.split() for line in table.splitlines()[2:] if line.strip()]
    # each cell is "<number> <unit>": pair them back up
    return {(r[0], r[1]): [" ".join(r[i : i + 2]) for i in range(2, 12, 2)] for r in rows}


def test_plan_with_bf16_and_fp32_main_params_prints_bytes_per_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "tests.unit.test_cli:small_mlp", "--world-sizes", "2", "4"]
    code, out, err = run_cli([*argv, "--dtype", "bf16", "--main-params", "fp32"], capsys)
    assert code == 0, err
    assert "bf16 parameters and gradients, fp32 main copy, AdamW's 2 fp32 states" in out
    total = sum(p.numel() for p in small_mlp().parameters())  # 4,096 + 64 = 4,160
    rows = memory_rows(out)
    # flat: each rank owns total / world_size; 2 B params and grads, 4 B main, 2 x 4 B state
    owned = total // 4
    assert rows[("4", "flat")] == [
        format_bytes(n)
        for n in (2 * total, 2 * total, 4 * owned, 8 * owned, 4 * total + 12 * owned)
    ]
    # the balance table above is unchanged by the new flags
    code, plain, _ = run_cli(argv, capsys)
    assert code == 0 and out.startswith(plain.rstrip("\n")) and "bytes per rank" not in plain


def test_plan_bytes_without_a_main_copy_keep_the_state_in_the_parameters_dtype(
    capsys: pytest.CaptureFixture[str],
) -> None:
    total = sum(p.numel() for p in small_mlp().parameters())
    for flags, param, main_b, state in [
        (["--dtype", "bf16"], 2, 0, 2 * 2),
        (["--dtype", "fp16"], 2, 0, 2 * 2),
        (["--main-params", "fp32"], 4, 0, 2 * 4),  # fp32 parameters need no main copy
        (["--dtype", "fp32"], 4, 0, 2 * 4),
    ]:
        argv = ["plan", "tests.unit.test_cli:small_mlp", "--world-sizes", "2", *flags]
        code, out, err = run_cli(argv, capsys)
        assert code == 0, err
        owned = total // 2
        want = [param * total, param * total, main_b * owned, state * owned]
        assert memory_rows(out)[("2", "flat")][:4] == [format_bytes(n) for n in want]


def small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU())


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["train", "--bogus"],
        ["train", "--epochs", "0"],
        ["train", "--lr", "-1"],
        ["train", "--lr", "nan"],
        ["train", "--nproc", "two"],
        ["train", "--nproc", "4", "--batch-size", "2"],
        ["train", "--overlap", "--impl", "torch"],
        ["train", "--partition", "even"],
        ["train", "--dtype", "fp16"],  # no GradScaler in the job
        ["train", "--main-params", "bf16"],
        ["train", "--main-params", "fp32"],  # fp32 parameters need no main copy
        ["train", "--dtype", "bf16", "--main-params", "fp32", "--impl", "torch"],
        ["train", "--dtype", "bf16", "--checkpoint", "ck"],
        ["train", "--nproc", "4", "--shard-size", "3"],
        ["train", "--shard-size", "0"],
        ["train", "--nproc", "4", "--shard-size", "2", "--impl", "torch"],
        ["train", "--save-every", "5"],
        ["train", "--wire-dtype", "fp32"],
        ["train", "--gather-dtype", "int8", "--impl", "torch"],
        ["train", "--wire-dtype", "int8", "--impl", "torch"],
        ["train", "--snapshot-every", "0"],
        ["train", "--snapshot-dir", "/dev/shm/x"],  # no --snapshot-every
        ["train", "--snapshot-every", "5", "--impl", "torch"],
        ["train", "--snapshot-every", "5", "--dtype", "bf16"],
        ["train", "--nproc", "4", "--shard-size", "2", "--snapshot-every", "5"],
        ["train", "--snapshot-every", "5"],  # no run id outside torchrun: --snapshot-dir
        ["demo", "--grace-s", "5"],
        ["plan"],
        ["plan", "gpt2-small", "--world-sizes", "0"],
        ["plan", "gpt2-small", "--dtype", "int8"],
        ["plan", "gpt2-small", "--main-params", "bf16"],
        ["plan", "no-such-model"],
        ["plan", "no_such_module_xyz:f"],
        ["plan", "tests.unit.test_cli:missing"],
        ["plan", "tests.unit.test_cli:not_a_module"],
        ["plan", "tests.unit.test_cli:needs_arguments"],
        ["plan", "tests.unit.test_cli:raises_inside"],
        ["plan", "gpt2-small", "--world-sizes", "64", "12", "--shard-size", "8"],
        ["plan", "gpt2-small", "--shard-size", "0"],
        ["plan", "gpt2-small", "--world-sizes", "64", "--simulate", "0,64"],
        ["plan", "gpt2-small", "--world-sizes", "64", "--simulate", "-1"],
        ["plan", "gpt2-small", "--world-sizes", "64", "--simulate", "0;1"],
        ["plan", "llama-7b", "--world-sizes", "64", "--simulate", "0"],  # 50 GiB to allocate
    ],
)
def test_bad_arguments_exit_2_with_one_line_on_stderr(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(argv, capsys)
    assert code == 2
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert "error:" in err


def _resume(tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    out_path = tmp_path / "out.pt"
    code, out, err = run_cli(
        ["train", "--resume", str(ckpt), "--checkpoint", str(out_path)], capsys
    )
    assert out == "" and len(err.splitlines()) == 1, err
    assert not out_path.exists()  # nothing touched
    return code, err


def test_missing_checkpoint_exits_2_and_touches_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _resume(tmp_path, tmp_path / "missing.pt", capsys)
    assert code == 2 and "does not exist" in err


@pytest.mark.parametrize(
    "content", [b"", b"not a checkpoint", b"PK\x03\x04 truncated zip"], ids=repr
)
def test_corrupt_checkpoint_exits_2_and_touches_nothing(
    content: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(content)
    code, err = _resume(tmp_path, bad, capsys)
    assert code == 2 and "corrupt" in err


def test_foreign_torch_file_is_refused_as_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(2)}, other)
    code, err = _resume(tmp_path, other, capsys)
    assert code == 2 and "not written by" in err


def _checkpoint(path: Path, epoch: int, hidden: int = 8) -> None:
    """A single-file checkpoint, the format earlier versions (and --impl torch) write."""
    model = train.build_model(hidden)
    train.save_checkpoint(
        path,
        {
            "format": train.CHECKPOINT_FORMAT,
            "model": model.state_dict(),
            "optimizer": torch.optim.Adam(model.parameters()).state_dict(),
            "epoch": epoch,
            "args": {"hidden": hidden},
        },
    )


def test_a_single_file_checkpoint_with_flipped_bytes_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ck.pt"
    _checkpoint(ckpt, epoch=1, hidden=64)
    raw = bytearray(ckpt.read_bytes())
    mid = len(raw) // 2
    raw[mid : mid + 64] = bytes(b ^ 0xFF for b in raw[mid : mid + 64])
    ckpt.write_bytes(bytes(raw))
    code, err = _resume(tmp_path, ckpt, capsys)
    assert code == 2 and "corrupt" in err, err


def test_a_checkpoint_whose_optimizer_is_of_another_model_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ck.pt"
    _checkpoint(ckpt, epoch=1)
    payload = torch.load(ckpt, weights_only=True)
    other = train.build_model(9)
    adam = torch.optim.Adam(other.parameters())
    for p in other.parameters():
        p.grad = torch.ones_like(p)
    adam.step()
    payload["optimizer"] = adam.state_dict()
    torch.save(payload, ckpt)
    code, err = _resume(tmp_path, ckpt, capsys)
    assert code == 2 and "does not fit the demo MLP" in err and "optimizer state" in err, err


def test_checkpoint_with_wrong_shapes_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ck.pt"
    _checkpoint(ckpt, epoch=1)
    payload = torch.load(ckpt)
    payload["args"]["hidden"] = 9
    torch.save(payload, ckpt)
    code, err = _resume(tmp_path, ckpt, capsys)
    assert code == 2 and "does not fit" in err


def test_resuming_a_finished_checkpoint_names_the_epochs_to_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ck.pt"
    _checkpoint(ckpt, epoch=3)
    code, _, err = run_cli(["train", "--resume", str(ckpt), "--epochs", "3"], capsys)
    assert code == 2 and "--epochs 4" in err


def test_checkpoint_in_missing_directory_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(["train", "--checkpoint", str(tmp_path / "no" / "ck.pt")], capsys)
    assert code == 2 and "does not exist" in err


def test_save_checkpoint_interrupted_mid_write_keeps_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "ck.pt"
    _checkpoint(ckpt, epoch=1)
    before = ckpt.read_bytes()

    def crash(obj: object, f: object) -> None:
        f.write(b"partial")  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    monkeypatch.setattr(train.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        _checkpoint(ckpt, epoch=2)
    assert ckpt.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # no temp file left behind


def test_bench_lists_the_scripts_in_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["bench", "--list"], capsys)
    assert code == 0
    assert all(Path(line).name.startswith("bench_") for line in out.splitlines())
    assert out


def test_bench_quick_leaves_out_the_compiled_benchmarks_and_says_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 42: ``bench --quick`` did not finish in 300 s, torchao compiling its step."""
    listed = {Path(line).name for line in run_cli(["bench", "--list"], capsys)[1].splitlines()}
    assert set(cli.NOT_QUICK) <= listed  # each still names a benchmark
    code, out, _ = run_cli(["bench", "--quick", "--list"], capsys)
    assert code == 0
    left = [line for line in out.splitlines() if line.startswith("-- left out by --quick: ")]
    assert [line.split()[5] for line in left] == list(cli.NOT_QUICK), left
    assert "bench_lowbit_compiled.py (it compiles torchao's" in out
    assert {Path(line).name for line in out.splitlines() if line not in left} == listed - set(
        cli.NOT_QUICK
    )


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_bench_quick_runs_the_mlp_alone_where_a_script_also_times_the_gpt(
    quick: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 42, item 8: ``bench --quick`` took 154 s on 2 idle cores, 92 of them in the two
    scripts that time the small GPT besides the MLP; quick, they time the MLP alone."""
    bench_dir = Path(cli.__file__).resolve().parents[3] / "benchmarks"
    for name, extra in cli.QUICK_ARGS.items():  # each script takes what it is given
        text = (bench_dir / name).read_text()
        assert all(f'"{word}"' in text for word in extra), name
    for name in ("bench_alpha.py", *cli.QUICK_ARGS):
        (tmp_path / name).write_text('"""A benchmark."""\n')
    ran: dict[str, list[str]] = {}

    def run(argv: list[str], check: bool) -> subprocess.CompletedProcess[str]:
        ran[Path(argv[1]).name] = argv[2:]
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(cli.subprocess, "run", run)
    assert run_cli(["bench", "--dir", str(tmp_path), *["--quick"] * quick], capsys)[0] == 0
    for name, argv in ran.items():
        models = argv[argv.index("--models") + 1 :][:1] if "--models" in argv else []
        assert models == (["mlp"] if quick and name in cli.QUICK_ARGS else []), (name, argv)
    assert set(ran) == {"bench_alpha.py", *cli.QUICK_ARGS}


def test_bench_rejects_a_directory_without_benchmarks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(["bench", "--dir", str(tmp_path)], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "no benchmarks/bench_*.py" in err


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the command gets as far as starting ranks."""

    def launch(*args: object, **kwargs: object) -> int:
        raise AssertionError("ranks were started; the error should have come first")

    monkeypatch.setattr(train, "launch", launch)


@pytest.mark.parametrize(
    ("target", "problem"),
    [
        (
            "tests.unit.test_cli:needs_arguments",
            "needs arguments (missing a required argument: 'width')",
        ),
        ("tests.unit.test_cli:raises_inside", "raised RuntimeError: no weights here"),
        ("broken_models:build", "syntax error in"),
    ],
)
def test_plan_of_a_bad_model_function_names_the_problem_in_one_line(
    target: str,
    problem: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "broken_models.py").write_text("def build(:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run_cli(["plan", target], capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and problem in err, err


def test_resume_with_a_conflicting_hidden_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_launch: None
) -> None:
    ckpt = tmp_path / "ck.pt"
    _checkpoint(ckpt, epoch=1, hidden=8)
    code, out, err = run_cli(
        ["train", "--resume", str(ckpt), "--epochs", "2", "--hidden", "16"], capsys
    )
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert "--hidden 16 conflicts with checkpoint" in err and "hidden 8" in err


@pytest.mark.parametrize("hidden", [[], ["--hidden", "8"]], ids=["no --hidden", "same --hidden"])
def test_resume_takes_the_checkpoints_hidden(
    hidden: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ckpt = tmp_path / "ck.pt"
    _checkpoint(ckpt, epoch=1, hidden=8)
    started: list[train.TrainConfig] = []

    def launch(cfg: train.TrainConfig, nproc: int, timeout_s: float) -> int:
        started.append(cfg)
        return 0

    monkeypatch.setattr(train, "launch", launch)
    code, _, err = run_cli(["train", "--resume", str(ckpt), "--epochs", "2", *hidden], capsys)
    assert code == 0, err
    assert [cfg.hidden for cfg in started] == [8]


def _unwritable_directory(tmp_path: Path) -> Path:
    """A directory this process cannot create files in (root ignores permission bits)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    candidates = [locked, Path("/sys")]
    for directory in candidates:
        try:
            with tempfile.TemporaryFile(dir=directory):
                pass
        except OSError:
            return directory
    pytest.skip("no directory here refuses new files to this process")


def test_checkpoint_in_an_unwritable_directory_exits_2_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_launch: None
) -> None:
    directory = _unwritable_directory(tmp_path)
    before = sorted(directory.iterdir())
    code, out, err = run_cli(["train", "--checkpoint", str(directory / "ck.pt")], capsys)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert "cannot create files in" in err
    assert sorted(directory.iterdir()) == before


@pytest.mark.parametrize("command", ["train", "demo"])
@pytest.mark.parametrize("module", ["sklearn", "tqdm"])
def test_train_without_the_demo_extra_names_it_and_exits_2(
    command: str,
    module: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    no_launch: None,
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # what a missing module looks like to import
    code, out, err = run_cli([command], capsys)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert "pip install 'zero_functional[demo]'" in err
    assert {"sklearn": "scikit-learn", "tqdm": "tqdm"}[module] in err


def test_version_prints_the_packages_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["--version"], capsys)
    assert code == 0, err
    assert out == f"zero-functional {zero_functional.__version__}\n"


@needs_partition
def test_plan_finds_a_module_in_the_current_directory_as_python_dash_m_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "cwd_models_zf.py").write_text(
        "from torch import nn\n\ndef build():\n    return nn.Linear(4, 4)\n"
    )
    monkeypatch.chdir(tmp_path)
    # the `zero-functional` script's sys.path: its own folder first, not the current directory
    here = os.getcwd()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or ".") != here])
    try:
        code, out, err = run_cli(["plan", "cwd_models_zf:build", "--world-sizes", "2"], capsys)
    finally:
        sys.modules.pop("cwd_models_zf", None)
    assert code == 0, err
    assert "cwd_models_zf:build: 2 tensors, 20 parameters" in out


def test_plan_of_a_module_found_nowhere_says_where_it_looked_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["plan", "nowhere_to_be_found_zf:build"], capsys)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert "no module named 'nowhere_to_be_found_zf'" in err, err
    assert f"the current directory {os.getcwd()} included" in err, err
    assert "run from the folder that holds it" in err and "PYTHONPATH" in err, err


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch, no_launch: None) -> None:
    """Fail the test if the command starts ranks or a benchmark script."""

    def run(*args: object, **kwargs: object) -> object:
        raise AssertionError("a benchmark was started; the error should have come first")

    monkeypatch.setattr(cli.subprocess, "run", run)


TOO_MANY = "99999999999999999999"


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["train", "--epochs", TOO_MANY], "--epochs: expected an integer from 1 to 1,000,000"),
        (["demo", "--epochs", TOO_MANY], "--epochs: expected an integer from 1 to 1,000,000"),
        (["train", "--seed", TOO_MANY], "torch.manual_seed's range"),
        (["train", "--seed", str(2**64)], "torch.manual_seed's range"),
        (["train", "--seed", str(-(2**63) - 1)], "torch.manual_seed's range"),
        (["train", "--nproc", "65"], "from 1 to 64 (gloo ranks on this one machine)"),
        (["train", "--nproc", "9" * 5000], "expected an integer from 1 to 64, got '999"),
        (["train", "--batch-size", "1439"], "the digits set has 1,438 training images"),
        (["train", "--hidden", "1000000"], "--hidden: expected an integer from 1 to 4,096"),
        (["train", "--bucket-cap-mb", "1e300"], "up to 1,048,576 (1 TiB)"),
        (["train", "--timeout", "1e300"], "up to 604,800 (a week)"),
        (["plan", "gpt2-small", "--world-sizes", TOO_MANY], "from 1 to 1,048,576"),
        (["bench", "--world-sizes", "1000", "--quick"], "from 1 to 64 (gloo ranks"),
        (["bench", "--rounds", TOO_MANY], "--rounds: expected an integer from 1 to 10,000"),
        (["bench", "--numel", TOO_MANY], "--numel: expected an integer from 1 to 1,000,000,000"),
    ],
)
def test_numeric_flags_out_of_bounds_exit_2_before_anything_starts(
    argv: list[str],
    problem: str,
    capsys: pytest.CaptureFixture[str],
    nothing_starts: None,
) -> None:
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert problem in err, err


def test_numeric_flags_take_their_bounds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    started: list[tuple[train.TrainConfig, int]] = []

    def launch(cfg: train.TrainConfig, nproc: int, timeout_s: float) -> int:
        started.append((cfg, nproc))
        return 0

    monkeypatch.setattr(train, "launch", launch)
    for argv in (
        ["--nproc", "64", "--epochs", "1000000", "--seed", str(2**64 - 1)],
        ["--nproc", "1", "--seed", str(-(2**63)), "--batch-size", "1438", "--hidden", "4096"],
    ):
        code, _, err = run_cli(["train", *argv], capsys)
        assert code == 0, err
    (first, nproc), (second, _) = started
    assert (nproc, first.epochs, first.seed) == (64, 1_000_000, 2**64 - 1)
    assert (second.seed, second.batch_size, second.hidden) == (-(2**63), 1438, 4096)


def test_a_shard_size_that_does_not_divide_the_ranks_names_the_ones_that_do(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_cli(["train", "--nproc", "6", "--shard-size", "4"], capsys)
    assert code == 2 and out == "", err
    assert err == (
        "zero-functional train: error: --shard-size: shard size 4 does not divide world size 6: "
        "pass one of its divisors, 1, 2, 3, 6 (--nproc)\n"
    )
    code, _, err = run_cli(["train", "--shard-size", "0"], capsys)
    assert code == 2 and "expected an integer from 1 to 64, got '0'" in err, err


def test_plan_with_shard_size_prints_state_and_bytes_within_and_across_nodes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "tests.unit.test_cli:small_mlp", "--world-sizes", "8", "64"]
    code, plain, _ = run_cli(argv, capsys)
    code, out, err = run_cli([*argv, "--shard-size", "8"], capsys)
    assert code == 0, err
    assert out.startswith(plain)  # the plan above is unchanged by the flag
    table = out.split("hybrid sharding, shard size 8")[1].splitlines()
    rows = {r[0]: r for r in (line.split() for line in table[4:])}
    total = sum(p.numel() for p in small_mlp().parameters())  # 4,160 fp32 elements
    b = 4 * total
    # world, R x S, flat state (8 B per owned element), sorted-greedy, within, across, 1-D
    assert rows["64"][1:4] == ["8", "x", "8"]
    cells = [" ".join(rows["64"][i : i + 2]) for i in range(4, 16, 2)]
    assert cells == [
        format_bytes(n)
        for n in (
            8 * total / 8,
            8 * 4096,  # the weight is one tensor: sorted-greedy gives it to one rank whole
            2 * b * 7 / 8,
            2 * (b / 8) * 7 / 8,
            8 * total / 64,
            2 * b * 63 / 64,
        )
    ]
    assert " ".join(rows["8"][10:12]) == "0 B"  # 1 x 8: nothing crosses nodes


def test_plan_shard_size_that_does_not_divide_a_world_size_names_the_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_cli(
        ["plan", "gpt2-small", "--world-sizes", "64", "12", "--shard-size", "8"], capsys
    )
    assert code == 2 and out == ""
    assert err == (
        "zero-functional plan: error: --shard-size: shard size 8 does not divide world size 12: "
        "pass one of its divisors, 1, 2, 3, 4, 6, 12 (--world-sizes)\n"
    )


def test_plan_simulate_builds_the_optimizer_as_those_ranks_would(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from zero_functional.core.plans import ownership_for

    argv = [
        "plan",
        "tests.unit.test_cli:small_mlp",
        "--world-sizes",
        "1024",
        "--simulate",
        "0,1023",
    ]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    table = out.split("simulated ranks")[1].splitlines()[2:]
    rows = {(r[1], r[3]): r for r in (line.split() for line in table)}
    assert len(rows) == 4  # 2 ranks x 2 partitions
    params = list(small_mlp().parameters())
    plan = ownership_for("flat", [{"params": params}], 1024)  # what the optimizer's own plan says
    loads = [sum(s.stop - s.start for s in plan.owned(r)) for r in (0, 1023)]
    for rank, load in zip((0, 1023), loads):
        world, _, shard, _, pieces, elements = rows[(str(rank), "flat")][:6]
        assert (world, shard) == ("1024", "1024")
        assert int(elements.replace(",", "")) == load
        assert int(pieces) == len(plan.owned(rank))
        # AdamW's 2 fp32 moments per owned element and a 4-byte step count per piece
        state = " ".join(rows[(str(rank), "flat")][6:8])
        assert state == format_bytes(8 * load + 4 * int(pieces))
        assert float(rows[(str(rank), "flat")][-1]) < 10  # seconds
    assert loads[0] > 0  # (flat pieces are aligned: 4,160 elements fill the first ranks only)
    # sorted-greedy at 1,024 ranks: the weight to rank 0, the bias to rank 1, rank 1023 nothing
    assert rows[("0", "sorted-greedy")][4:6] == ["1", "4,096"]
    assert rows[("1023", "sorted-greedy")][4:8] == ["0", "0", "0", "B"]

    # hybrid: each rank owns its share of its shard group of 8
    code, out, err = run_cli([*argv, "--shard-size", "8"], capsys)
    assert code == 0, err
    table = out.split("simulated ranks")[1].splitlines()[2:]
    flat_rows = [r.split() for r in table if " flat " in r]
    assert [r[2] for r in flat_rows] == ["8", "8"]
    assert [int(r[5].replace(",", "")) for r in flat_rows] == [520, 520]


def test_plan_simulate_names_the_ranks_each_world_size_has(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "gpt2-small", "--world-sizes", "1024", "64", "--simulate", "0,1023"]
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == ""
    assert err == (
        "zero-functional plan: error: --simulate: rank 1023 is not a rank of world size 64: "
        "pass ranks from 0 to 63\n"
    )


def test_plan_with_compressed_collectives_prints_bytes_per_step_beside_ddps(
    capsys: pytest.CaptureFixture[str],
) -> None:
    total = sum(p.numel() for p in small_mlp().parameters())  # 4,160
    argv = ["plan", "tests.unit.test_cli:small_mlp", "--world-sizes", "4"]
    code, out, err = run_cli([*argv, "--wire-dtype", "int8", "--gather-dtype", "bf16"], capsys)
    assert code == 0, err
    # gather_dtype keeps fp32 main copies of an fp32 model's owned pieces: 4/N B more each
    assert "fp32 parameters and gradients, fp32 main copy" in out
    owned = total // 4
    assert memory_rows(out)[("4", "flat")][2] == format_bytes(4 * owned)
    row = out.split("ours  x DDP\n")[1].splitlines()[0].split()
    # DDP's ring all-reduce: 2 x 3/4 x 4 B; int8: 1 B + 4 B per 256 (17 blocks); bf16: 2 B
    ddp, grads, params = 2 * 0.75 * 4 * total, 0.75 * (4 * 17 + total), 0.75 * 2 * total
    assert row[0] == "4" and " ".join(row[1:3]) == format_bytes(ddp)
    assert " ".join(row[3:5]) == format_bytes(grads) and " ".join(row[5:7]) == format_bytes(params)
    assert float(row[-1]) == pytest.approx((grads + params) / ddp, abs=1e-3)
    code, _, err = run_cli([*argv, "--wire-dtype", "fp32"], capsys)
    assert code == 2 and "invalid choice: 'fp32'" in err
