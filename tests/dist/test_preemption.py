"""Preemption: ``train --checkpoint`` on SIGTERM saves after a step every rank agrees on, exits
143, and ``--resume`` ends bitwise where an uninterrupted run ends; past ``--grace-s`` it exits
143 without a new checkpoint, the last complete one intact.

The SIGTERM is sent from inside rank 0 at a chosen step (a script run as ``python -m``-like
subprocess patches ``train.rank_slice``, called once per step): to the launcher, as a scheduler
sends it, which forwards it to every rank; rank 0 waits until its own copy has arrived, so the
ranks stop after exactly that step, whatever the machine's load.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zero_functional import checkpoint
from zero_functional.app.cli import main
from zero_functional.app.preempt import EXIT_CODE
from zero_functional.app.train import build_model
from zero_functional.checkpoint import storage

from tests.helpers import forked_train_ranks

SIGTERM_AT_STEP_SCRIPT = """
import os
import signal
import sys
import time

from zero_functional.app import train
from zero_functional.checkpoint import atomic_dir

STOP_AT = int(os.environ["STOP_AT"])
_slice, _commit = train.rank_slice, atomic_dir.commit
steps = [0]
stopping = [False]


def slice_then_sigterm(batch, rank, world_size):
    steps[0] += 1
    if rank == 0 and steps[0] == STOP_AT:
        preemption = signal.getsignal(signal.SIGTERM).__self__  # the job's Preemption
        os.kill(os.getppid(), signal.SIGTERM)  # the launcher, as a scheduler would
        deadline = time.monotonic() + 60
        while not preemption.requested:  # until the launcher has forwarded it here
            assert time.monotonic() < deadline, "SIGTERM was not forwarded to rank 0"
            time.sleep(0.01)
        stopping[0] = True
    return _slice(batch, rank, world_size)


def commit_or_hang(tmp, path):  # rank 0 commits every save
    if stopping[0] and os.environ.get("HANG_COMMIT"):
        time.sleep(600)  # the save at SIGTERM is written, but never committed
    return _commit(tmp, path)


# top level: spawned ranks import this script too, so they run with the patches
train.rank_slice = slice_then_sigterm
atomic_dir.commit = commit_or_hang

if __name__ == "__main__":
    from zero_functional.app.cli import main

    sys.exit(main(sys.argv[1:]))
"""

COMMON = ["--nproc", "2", "--epochs", "2", "--hidden", "16", "--batch-size", "96"]
COMMON += ["--no-progress", "--timeout", "120"]
STEPS_PER_EPOCH = 15  # ceil(1,438 training images / 96)


@pytest.fixture(autouse=True)
def _forked_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    forked_train_ranks(monkeypatch)


def _sigterm_at(
    step: int, tmp_path: Path, *args: str, hang_commit: bool = False
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "sigterm_at_step.py"
    script.write_text(SIGTERM_AT_STEP_SCRIPT)
    env = {**os.environ, "STOP_AT": str(step)}
    if hang_commit:
        env["HANG_COMMIT"] = "1"
    return subprocess.run(
        [sys.executable, str(script), "train", *COMMON, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _position(path: Path) -> tuple[int, int]:
    extra = storage.read_objects(path, ["extra"])["extra"]
    assert isinstance(extra, dict)
    return int(extra["epoch"]), int(extra["step"])


def _final(path: Path) -> tuple[list[torch.Tensor], dict[str, object]]:
    model = build_model(16)
    adam = torch.optim.Adam(model.parameters())
    checkpoint.load(path, model=model, optimizer=adam)
    return [p.detach() for p in model.parameters()], adam.state_dict()


def test_sigterm_saves_at_an_agreed_step_and_the_resumed_run_ends_bitwise_as_an_uninterrupted_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stopped = tmp_path / "stopped"
    proc = _sigterm_at(20, tmp_path, "--no-reference", "--checkpoint", str(stopped))
    assert proc.returncode == EXIT_CODE, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert (
        "zero-functional train: every rank stopped by SIGTERM after epoch 1, step 5; saved a "
        f"checkpoint there ({stopped}): --resume it to continue\n"
    ) in proc.stderr, proc.stderr
    assert _position(stopped) == divmod(20, STEPS_PER_EPOCH)  # mid-epoch, after step 20

    resume = ["--resume", str(stopped), "--checkpoint", str(stopped)]
    code = main(["train", *COMMON, *resume])  # the reference run resumes mid-epoch too
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "parity with plain DDP + torch.optim.Adam (seed 0): bitwise equal\n" in out, out
    assert _position(stopped) == (2, 0)

    whole = tmp_path / "whole"
    code = main(["train", *COMMON, "--no-reference", "--checkpoint", str(whole)])
    assert code == 0, capsys.readouterr().err
    (params, state), (ref_params, ref_state) = _final(stopped), _final(whole)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    for index, entry in ref_state["state"].items():  # type: ignore[attr-defined]
        for key, value in entry.items():
            assert torch.equal(state["state"][index][key], value), (index, key)  # type: ignore[index]


def test_past_the_grace_period_ranks_exit_143_naming_themselves_and_the_last_checkpoint_stays(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ck"
    args = ["--no-reference", "--checkpoint", str(ckpt), "--grace-s", "1"]
    proc = _sigterm_at(20, tmp_path, *args, hang_commit=True)
    assert proc.returncode == EXIT_CODE, proc.stderr
    assert (
        "zero-functional train: rank 0: SIGTERM's grace of 1 s (--grace-s) ran out before a "
        f"checkpoint was saved to {ckpt}; exiting with code 143 without it: {ckpt} keeps the "
        "last complete one\n"
    ) in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert _position(ckpt) == (1, 0)  # the end of epoch 1, the last save that was committed
    assert storage.verify(ckpt) > 0
    # the save at SIGTERM, written but not committed, is beside it; the next save removes it
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("ck.tmp-")]) == 1
