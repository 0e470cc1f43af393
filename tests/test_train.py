"""End to end: `zero-functional train` on 2 ranks with a checkpoint, resumed on 1 rank.

One test, because each spawn of gloo ranks costs seconds: it checks the exit codes, the parity
of ZeRO with plain DDP + ``torch.optim.Adam`` in both runs, and the checkpoint's contents.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from zero_functional.cli import main
from zero_functional.train import CHECKPOINT_FORMAT, build_model


def _ours_importable() -> bool:
    try:
        importlib.import_module("zero_functional.optimizer")
    except ImportError:
        return False
    return True


@pytest.mark.skipif(
    not _ours_importable(),
    reason="zero_functional.optimizer (another session's module) does not import yet",
)
def test_train_checkpoint_then_resume_at_another_world_size_matches_plain_ddp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ck.pt"
    common = ["--no-progress", "--hidden", "32", "--batch-size", "96", "--timeout", "120"]

    code = main(["train", "--nproc", "2", "--epochs", "1", "--checkpoint", str(ckpt), *common])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "parity with plain DDP + torch.optim.Adam (seed 0): equal" in out
    rank_rows = [line for line in out.splitlines() if line.lstrip()[:1].isdigit()]
    assert len(rank_rows) == 2  # ranks
    assert all("50.0%" in row for row in rank_rows), out  # partition=flat: an even split

    saved = torch.load(ckpt, weights_only=True)
    assert saved["format"] == CHECKPOINT_FORMAT and saved["epoch"] == 1
    build_model(32).load_state_dict(saved["model"])  # the full model, not one rank's view
    assert sorted(saved["optimizer"]["state"]) == list(range(6))  # every rank's shard

    code = main(
        [
            "train",
            "--nproc",
            "1",
            "--epochs",
            "2",
            "--resume",
            str(ckpt),
            "--checkpoint",
            str(ckpt),
            *common,
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "parity with plain DDP + torch.optim.Adam (seed 0): equal" in out
    assert "1 rank(s)" in out
    assert torch.load(ckpt, weights_only=True)["epoch"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # no temp files left behind
