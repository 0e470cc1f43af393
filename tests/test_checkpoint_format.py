"""Each checkpoint format version's reader, on a checkpoint written by hand in that version's
layout (literal keys, not the current writer), in one process: old checkpoints keep loading.

The layouts: ``zero_functional.checkpoint/1`` (a storage directory of ``model.<name>``,
``state.<name>.<key>``, ``param_groups``, ``extra``, ``format``), and the train job's
``zero_functional.app.train/1`` as a directory (checkpoint/1 with the job's ``extra``) or as one
``torch.save`` file (what ``--impl torch`` and earlier versions write).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from zero_functional import checkpoint
from zero_functional.app import train, train_file
from zero_functional.checkpoint import format as checkpoint_format
from zero_functional.checkpoint import storage
from zero_functional.checkpoint.storage import CheckpointError

HIDDEN = 8
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def adam_state(model: nn.Module) -> dict[int, dict[str, Tensor]]:
    """Distinct, recognisable Adam state for each parameter."""
    return {
        i: {
            "step": torch.tensor(3.0),
            "exp_avg": torch.full_like(p, 0.25 * (i + 1)),
            "exp_avg_sq": torch.full_like(p, 0.5 * (i + 1)),
        }
        for i, p in enumerate(model.parameters())
    }


def write_v1_by_hand(
    path: Path,
    model: nn.Module,
    lr: float,
    extra: Any,
    fmt: object = "zero_functional.checkpoint/1",
) -> dict[int, dict[str, Tensor]]:
    """A checkpoint/1 directory of ``model`` (values 1, 2, ...) and Adam state, keys spelled out."""
    pieces: dict[str, Any] = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        values = torch.arange(p.numel(), dtype=p.dtype) + i
        pieces[f"model.{name}"] = (tuple(p.shape), p.dtype, [(0, p.numel(), values)])
    state = adam_state(model)
    names = [name for name, _ in model.named_parameters()]
    for i, entry in state.items():
        for key, value in entry.items():
            flat = value.reshape(-1) if value.dim() else value.reshape(1)
            shape = tuple(value.shape)
            pieces[f"state.{names[i]}.{key}"] = (shape, value.dtype, [(0, flat.numel(), flat)])
    groups = [{"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0, "params": names}]
    objects = {"format": fmt, "extra": extra, "param_groups": groups}
    storage.save_pieces(path, pieces, objects)
    return state


def assert_adam_loaded(opt: torch.optim.Optimizer, state: dict[int, dict[str, Tensor]]) -> None:
    loaded = opt.state_dict()["state"]
    assert loaded.keys() == state.keys()
    for i, entry in state.items():
        assert loaded[i].keys() == entry.keys()
        for key, value in entry.items():
            assert torch.equal(loaded[i][key], value), (i, key)


def test_a_v1_directory_written_by_hand_loads_into_a_model_and_a_plain_optimizer(
    tmp_path: Path,
) -> None:
    model = train.build_model(HIDDEN)
    state = write_v1_by_hand(tmp_path / "ck", model, 0.125, {"epoch": 4})
    fresh = train.build_model(HIDDEN)
    opt = torch.optim.Adam(fresh.parameters(), lr=1.0)
    assert checkpoint.load(tmp_path / "ck", model=fresh, optimizer=opt) == {"epoch": 4}
    for i, p in enumerate(fresh.parameters()):
        assert torch.equal(p.detach().reshape(-1), torch.arange(p.numel(), dtype=p.dtype) + i)
    assert_adam_loaded(opt, state)
    assert opt.param_groups[0]["lr"] == 0.125


def test_save_writes_the_v1_layout_the_v1_reader_reads(tmp_path: Path) -> None:
    """The writer stays on checkpoint/1: a change of keys needs a new version and reader."""
    model = train.build_model(HIDDEN)
    opt = torch.optim.Adam(model.parameters())
    opt.load_state_dict(
        {"state": adam_state(model), "param_groups": opt.state_dict()["param_groups"]}
    )
    checkpoint.save(tmp_path / "ck", model=model, optimizer=opt, extra="x")
    names = [name for name, _ in model.named_parameters()]
    expected = {"format": None, "extra": None, "param_groups": None}
    for name, p in model.named_parameters():
        expected[f"model.{name}"] = (tuple(p.shape), p.dtype)
        expected[f"state.{name}.step"] = ((), torch.float32)
        expected[f"state.{name}.exp_avg"] = (tuple(p.shape), p.dtype)
        expected[f"state.{name}.exp_avg_sq"] = (tuple(p.shape), p.dtype)
    assert storage.read_keys(tmp_path / "ck") == expected
    objects = storage.read_objects(tmp_path / "ck", ["format", "param_groups"])
    assert objects["format"] == checkpoint.FORMAT == "zero_functional.checkpoint/1"
    assert [g["params"] for g in objects["param_groups"]] == [names]  # type: ignore[attr-defined]


def test_a_format_no_reader_reads_is_refused_naming_it_and_changes_nothing(
    tmp_path: Path,
) -> None:
    model = train.build_model(HIDDEN)
    write_v1_by_hand(tmp_path / "v99", model, 0.1, None, fmt="zero_functional.checkpoint/99")
    storage.save_pieces(tmp_path / "none", {}, {"extra": 1})
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=r"has format 'zero_functional.checkpoint/99'"):
        checkpoint.load(tmp_path / "v99", model=model)
    with pytest.raises(CheckpointError, match="is not a checkpoint written by"):
        checkpoint.load(tmp_path / "none", model=model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert set(checkpoint_format.READERS) == {
        "zero_functional.checkpoint/1",
        "zero_functional.checkpoint/2",
    }


def test_a_train_v1_directory_written_by_hand_resumes(tmp_path: Path) -> None:
    model = train.build_model(HIDDEN)
    extra = {"format": "zero_functional.app.train/1", "epoch": 2, "args": {"hidden": HIDDEN}}
    state = write_v1_by_hand(tmp_path / "ck", model, 0.01, extra)
    ckpt = train.load_checkpoint(tmp_path / "ck")
    assert ckpt == {**extra, "sharded": str(tmp_path / "ck")}
    fresh = train.build_model(HIDDEN)
    opt = torch.optim.Adam(fresh.parameters())
    assert checkpoint.load(ckpt["sharded"], model=fresh, optimizer=opt) == extra
    assert_adam_loaded(opt, state)


def test_a_train_v1_directory_of_another_width_is_refused(tmp_path: Path) -> None:
    extra = {"format": "zero_functional.app.train/1", "epoch": 2, "args": {"hidden": HIDDEN + 1}}
    write_v1_by_hand(tmp_path / "ck", train.build_model(HIDDEN), 0.01, extra)
    with pytest.raises(CheckpointError, match="does not fit the demo MLP"):
        train.load_checkpoint(tmp_path / "ck")


def test_a_train_v1_single_file_written_by_hand_resumes(tmp_path: Path) -> None:
    model = train.build_model(HIDDEN)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    opt.load_state_dict(
        {"state": adam_state(model), "param_groups": opt.state_dict()["param_groups"]}
    )
    payload = {
        "format": "zero_functional.app.train/1",
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "epoch": 1,
        "args": {"hidden": HIDDEN},
    }
    torch.save(payload, tmp_path / "ck.pt")
    ckpt = train.load_checkpoint(tmp_path / "ck.pt")
    assert ckpt.keys() == payload.keys() and ckpt["epoch"] == 1
    fresh = train.build_model(HIDDEN)
    fresh.load_state_dict(ckpt["model"])
    resumed = torch.optim.Adam(fresh.parameters())
    resumed.load_state_dict(ckpt["optimizer"])
    assert_adam_loaded(resumed, adam_state(model))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_a_single_file_of_another_format_is_refused(tmp_path: Path) -> None:
    torch.save({"format": "zero_functional.app.train/0", "epoch": 1}, tmp_path / "ck.pt")
    with pytest.raises(CheckpointError, match="no format 'zero_functional.app.train/1'"):
        train.load_checkpoint(tmp_path / "ck.pt")


def test_the_old_import_paths_still_resolve() -> None:
    from zero_functional.app import train as train_checkpoint

    assert train_checkpoint.load_checkpoint is train.load_checkpoint
    assert train_checkpoint.save_checkpoint is train_file.write_train_file
    assert (
        train.CHECKPOINT_FORMAT
        == train_checkpoint.CHECKPOINT_FORMAT
        == "zero_functional.app.train/1"
    )
    assert checkpoint.model_state_dict is checkpoint_format.model_state_dict
    assert checkpoint.optimizer_state_dict is checkpoint_format.optimizer_state_dict
