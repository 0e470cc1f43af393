"""Bad input refused in one process, naming the fix: an empty or foreign checkpoint directory,
an optimizer built before its process group, ownership messages at 4,096 ranks (the cases on
ranks: ``tests/dist/test_reliability.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from zero_functional.optimizer import ZeroRedundancyOptimizer


def test_loading_an_empty_or_foreign_directory_names_what_it_is(tmp_path: Any) -> None:
    """Issue 34, item 11: not "corrupt" with an ``[Errno 2]`` but what the directory is."""
    import torch.distributed.checkpoint as dcp

    from zero_functional.checkpoint import CheckpointError, storage

    empty, foreign, other = tmp_path / "empty", tmp_path / "foreign", tmp_path / "other"
    empty.mkdir()
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(foreign), no_dist=True)
    cases = {
        empty: "is an empty directory, not a checkpoint",
        foreign: "torch.distributed.checkpoint directory that zero_functional did not write",
        other: r"holds no checkpoint \(no \.metadata; it holds notes\.txt\)",
        tmp_path / "absent": "there is no checkpoint directory at",
    }
    for path, message in cases.items():
        with pytest.raises(CheckpointError, match=message) as caught:
            storage.verify(path)
        assert "corrupt" not in str(caught.value) and "Errno" not in str(caught.value)


def test_an_optimizer_built_before_the_process_group_names_the_trainer_order() -> None:
    """Issue 34, item 13: building the optimizer before ``TrainingArguments`` (which
    initializes the process group) says so."""
    with pytest.raises(RuntimeError, match=r"after TrainingArguments\(\.\.\.\)"):
        ZeroRedundancyOptimizer(nn.Linear(2, 2).parameters(), torch.optim.Adam, lr=0.1)


def test_ownership_messages_stay_short_at_4096_ranks() -> None:
    """Issue 34, item 12: a parameter split over 4,096 ranks named in <= 2 KB (it was 6.6 KB)."""
    from zero_functional.core.ownership import flat_ownership

    ownership = flat_ownership([1 << 20, 1 << 22], 4096)
    with pytest.raises(ValueError, match=r"split across ranks 0, 1, .* and \d+ more") as e:
        ownership.owner(0)
    assert len(str(e.value)) <= 2048
    for call in (lambda: ownership.owned(4096), lambda: ownership.piece(0, 7)):
        try:
            call()
        except (ValueError, KeyError, IndexError) as error:
            assert len(str(error)) <= 2048, len(str(error))
