"""The README's commands, run to the end as a user would type them.

Every line of every ```bash block in README.md is one of the commands below; a new one that no
test knows how to run fails :func:`test_every_readme_command_is_run_by_a_test`, so the front
door cannot break again with CI green (issue 29: ``make demo`` crashed at its last line).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, forked_train_ranks, run_cli
from tests.unit.test_readme import cli_commands, readme_commands

MAKEFILE = ROOT / "Makefile"


TIMEOUT_S = 300


def torchrun_commands() -> list[list[str]]:
    return [shlex.split(c) for c in readme_commands() if c.startswith("torchrun ")]


def env_with_src() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return env


def run_in_subprocess(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``zero-functional ARGV`` as ``python -m zero_functional ARGV`` (the script's entry point)."""
    return subprocess.run(
        [sys.executable, "-m", "zero_functional", *argv],
        cwd=ROOT,
        env=env_with_src(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def test_make_demo_runs_to_the_end() -> None:
    """The Makefile's demo recipe, with this interpreter for the venv's: exit 0, the table, the
    parity line and the plan, then the closing line."""
    recipe = re.search(r"^demo:.*\n\t(.+)$", MAKEFILE.read_text(), re.MULTILINE)
    assert recipe is not None, "no demo target in the Makefile"
    argv = shlex.split(recipe.group(1).replace("$(BIN)/python", sys.executable))
    assert argv[1:] == ["-m", "zero_functional", "demo"], argv
    proc = subprocess.run(
        argv, cwd=ROOT, env=env_with_src(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "rank  optimizer state" in out
    assert "parity with plain DDP + torch.optim.Adam (seed 0): bitwise equal" in out
    assert "gpt2-small: 148 tensors, 124,439,808 parameters" in out
    for world in (2, 8, 64):
        assert re.search(rf"^\s+{world}\s+flat\s", out, re.MULTILINE), world
    assert out.rstrip().splitlines()[-1].startswith("demo finished in ")


FAKE_TOOL = '#!/bin/sh\necho "$(basename "$0") $*" >> "$(dirname "$0")/../../calls"\n'
"""A venv tool that only records its call (``pip install -q torch==2.13.0 -e .[demo]``)."""


def pip_installs(clone: Path, *targets: str) -> list[list[str]]:
    """The ``pip install`` calls (but pip's own upgrade) of ``make TARGETS`` in ``clone``, whose
    venv's tools only record their calls: the Makefile's stamps decide what is installed."""
    calls = clone / "calls"
    calls.unlink(missing_ok=True)
    subprocess.run(["make", "-s", *targets], cwd=clone, check=True, capture_output=True, timeout=60)
    lines = calls.read_text().splitlines() if calls.exists() else []
    argvs = [shlex.split(line) for line in lines if line.startswith("pip install")]
    return [argv for argv in argvs if "--upgrade" not in argv]


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """The Makefile and pyproject.toml of a fresh clone, with a venv of recording tools."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    os.utime(tmp_path / "pyproject.toml", (1e9, 1e9))  # older than any stamp make writes
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    for tool in ("pip", "python", "ruff", "mypy", "pytest"):
        (tmp_path / ".venv" / "bin" / tool).write_text(FAKE_TOOL)
        (tmp_path / ".venv" / "bin" / tool).chmod(0o755)
    return tmp_path


def extras_of(install: list[str]) -> set[str] | None:
    """The extras of ``pip install ... -e .[a,b]`` (``None``: no package) if it pins torch."""
    assert any(a.startswith("torch==") for a in install), f"torch not pinned: {install}"
    editable = install[install.index("-e") + 1] if "-e" in install else ""
    return set(editable[2:-1].split(",")) if editable.startswith(".[") else None


def test_make_demo_installs_only_the_demo_extra_and_make_test_the_rest(clone: Path) -> None:
    """Issue 42: ``make demo`` on a fresh clone installed every extra (Ray, Transformers). Now
    torch and the demo extra; a ``make test`` after it installs all the extras; a third
    ``make demo`` installs nothing."""
    demo = pip_installs(clone, "demo")
    assert [extras_of(i) for i in demo] == [{"demo"}], demo
    every = _extras_make_test_installs()
    test = pip_installs(clone, "test")
    assert [extras_of(i) for i in test] == [every], test
    assert pip_installs(clone, "demo") == []
    assert pip_installs(clone, "test") == []


def _extras_make_test_installs() -> set[str]:
    """Every extra but ``peers`` (DeepSpeed, which only benchmarks/bench_compressed.py times)."""
    extras = importlib.metadata.metadata("zero_functional").get_all("Provides-Extra") or []
    return set(extras) - {"peers"}


def test_make_demo_after_make_test_installs_nothing(clone: Path) -> None:
    every = _extras_make_test_installs()
    assert [extras_of(i) for i in pip_installs(clone, "test")] == [every]
    assert pip_installs(clone, "demo") == []


@pytest.mark.parametrize("argv", cli_commands("train"), ids=" ".join)
def test_readme_train_example_runs_to_the_end(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    forked_train_ranks(monkeypatch)  # the job's ranks forked, not spawned: 2 s less per rank
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err[-3000:]
    assert "rank  optimizer state" in out
    if "--no-reference" not in argv:  # compared with plain DDP at its end: bitwise at 2 ranks
        parity = [line for line in out.splitlines() if line.startswith("parity with")]
        assert parity and parity[0].endswith(": bitwise equal"), parity


@pytest.mark.bench  # about two minutes: make bench runs it
@pytest.mark.parametrize("argv", cli_commands("bench"), ids=" ".join)
def test_readme_bench_example_runs_to_the_end(argv: list[str]) -> None:
    proc = run_in_subprocess(argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== summary" in proc.stdout


def test_the_two_node_torchrun_example_runs_on_one_machine() -> None:
    """The README's two torchrun nodes, both on this machine: the master address becomes the
    loopback and the port a free one; nothing else of the commands changes."""
    nodes = torchrun_commands()
    assert len(nodes) == 2, nodes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for argv in nodes:
        argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
        argv[argv.index("--master-addr") + 1] = "127.0.0.1"
        argv[argv.index("--master-port") + 1] = port
        procs.append(
            subprocess.Popen(
                argv,
                cwd=ROOT,
                env=env_with_src(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=TIMEOUT_S))
    finally:
        for proc in procs:
            proc.kill()
    for proc, (_out, err) in zip(procs, outs):
        assert proc.returncode == 0, err[-3000:]
    assert "rank  optimizer state" in outs[0][0]
