"""Each checkpoint format version's reader, on a checkpoint written by hand in that version's
layout (literal keys, not the current writer), in one process: old checkpoints keep loading.

The layouts: ``zero_functional.checkpoint/1`` (a storage directory of ``model.<name>``,
``state.<name>.<key>``, ``param_groups``, ``extra``, ``format``; with ``ema.<name>`` and
``ema_n_averaged``, or a ``main_param`` state), ``zero_functional.checkpoint/2`` (checkpoint/1 plus
``quantized.<name>.<key>`` codes, scales and object), the same directories as the per-rank saves
(``.rank-<r>-of-<w>.json`` manifests) and the background writer (``.zero_functional-rank-<r>``
results files) leave them, saves of earlier versions without a marker or with a one-line one,
and the train job's ``zero_functional.app.train/1`` as a directory (checkpoint/1 with the job's
``extra``) or as one ``torch.save`` file (what ``--impl torch`` and earlier versions write).
Loads into our optimizer run in a one-rank gloo world of this process (:func:`one_rank`).
"""

from __future__ import annotations

import json
import pickle
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from zero_functional import checkpoint
from zero_functional.app import train, train_file
from zero_functional.checkpoint import format as checkpoint_format
from zero_functional.checkpoint import storage
from zero_functional.checkpoint.storage import CheckpointError
from zero_functional.ema import ShardedEMA
from zero_functional.optimizer import ZeroRedundancyOptimizer

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
    ema: bool = False,
) -> dict[int, dict[str, Tensor]]:
    """A checkpoint/1 directory of ``model`` (values 1, 2, ...) and Adam state, keys spelled
    out; with ``ema``, an EMA of each parameter (half its values) over 5 updates."""
    pieces: dict[str, Any] = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        values = torch.arange(p.numel(), dtype=p.dtype) + i
        pieces[f"model.{name}"] = (tuple(p.shape), p.dtype, [(0, p.numel(), values)])
        if ema:
            pieces[f"ema.{name}"] = (tuple(p.shape), p.dtype, [(0, p.numel(), values / 2)])
    state = adam_state(model)
    names = [name for name, _ in model.named_parameters()]
    for i, entry in state.items():
        for key, value in entry.items():
            flat = value.reshape(-1) if value.dim() else value.reshape(1)
            shape = tuple(value.shape)
            pieces[f"state.{names[i]}.{key}"] = (shape, value.dtype, [(0, flat.numel(), flat)])
    groups = [{"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0, "params": names}]
    objects = {"format": fmt, "extra": extra, "param_groups": groups}
    storage.save_pieces(path, pieces, {**objects, "ema_n_averaged": 5} if ema else objects)
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


# ---------------------------------------------------------------- in our optimizer; other layouts


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo world in this process, for our optimizer (no process is started)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/world", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def shard_state(zero: ZeroRedundancyOptimizer) -> dict[int, dict[str, Any]]:
    return {k: state for k, (_, state) in zero.shard_state().items()}


def test_a_v1_directory_written_by_hand_loads_into_our_optimizer_with_its_ema(
    tmp_path: Path, one_rank: None
) -> None:
    model = train.build_model(HIDDEN)
    state = write_v1_by_hand(tmp_path / "plain", model, 0.125, 3)
    write_v1_by_hand(tmp_path / "ema", model, 0.125, 3, ema=True)
    for partition in ("sorted_greedy", "flat"):
        fresh = train.build_model(HIDDEN)
        zero = ZeroRedundancyOptimizer(fresh.parameters(), torch.optim.Adam, partition=partition)
        ema = ShardedEMA(zero, decay=0.5, model=fresh)
        assert checkpoint.load(tmp_path / "ema", model=fresh, optimizer=zero, ema=ema) == 3
        loaded = shard_state(zero)
        for i, entry in state.items():
            assert loaded[i].keys() == entry.keys(), (partition, i)
            for key, value in entry.items():
                assert torch.equal(loaded[i][key].reshape(value.shape), value), (partition, i, key)
        assert zero.param_groups[0]["lr"] == 0.125
        assert ema.n_averaged() == 5
        for i, p in enumerate(fresh.parameters()):
            expected = (torch.arange(p.numel(), dtype=p.dtype) + i) / 2
            assert torch.equal(ema.pieces[i], expected), (partition, i)
        with pytest.raises(CheckpointError, match="holds no EMA of"):  # saved without one
            checkpoint.load(tmp_path / "plain", model=fresh, optimizer=zero, ema=ema)


def test_a_v1_main_copy_written_by_hand_fills_a_wider_model(tmp_path: Path) -> None:
    """A bf16 model trained with fp32 main copies: an fp32 model loads the main values."""
    main = torch.tensor([1.0 + 2**-12, -3.0, 0.5])
    pieces = {
        "model.w": ((3,), torch.bfloat16, [(0, 3, main.to(torch.bfloat16))]),
        "state.w.main_param": ((3,), torch.float32, [(0, 3, main)]),
        "state.w.step": ((), torch.float32, [(0, 1, torch.tensor([2.0]))]),
    }
    groups = [{"lr": 0.1, "params": ["w"]}]
    objects = {"format": "zero_functional.checkpoint/1", "extra": None, "param_groups": groups}
    storage.save_pieces(tmp_path / "ck", pieces, objects)
    wide = nn.ParameterDict({"w": nn.Parameter(torch.zeros(3))})
    checkpoint.load(tmp_path / "ck", model=wide)
    assert torch.equal(wide.w.detach(), main)
    narrow = nn.ParameterDict({"w": nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))})
    checkpoint.load(tmp_path / "ck", model=narrow)
    assert torch.equal(narrow.w.detach(), main.to(torch.bfloat16))


def test_a_v2_directory_written_by_hand_loads_quantized_state_bitwise(
    tmp_path: Path, one_rank: None
) -> None:
    from torchao.optim import AdamW8bit
    from torchao.optim.subclass_8bit import OptimState8bit

    torch.manual_seed(0)
    model = nn.Linear(64, 96)  # a 6144-element weight: quantized in blocks of 256
    names = ["weight", "bias"]
    moments = {}
    for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        value = OptimState8bit.zeros((96, 64), signed=signed, block_size=256)
        value.codes.copy_(torch.randint(0, 256, (96, 64), dtype=torch.uint8))
        value.scale.copy_(torch.rand(24) + 0.5)
        moments[key] = value
    pieces: dict[str, Any] = {
        "model.weight": ((96, 64), torch.float32, [(0, 6144, model.weight.detach().reshape(-1))]),
        "model.bias": ((96,), torch.float32, [(0, 96, model.bias.detach())]),
        "state.weight.step": ((), torch.float32, [(0, 1, torch.tensor([4.0]))]),
        "state.bias.step": ((), torch.float32, [(0, 1, torch.tensor([4.0]))]),
        "state.bias.exp_avg": ((96,), torch.float32, [(0, 96, torch.full((96,), 0.25))]),
        "state.bias.exp_avg_sq": ((96,), torch.float32, [(0, 96, torch.full((96,), 0.5))]),
    }
    objects: dict[str, Any] = {"format": "zero_functional.checkpoint/2", "extra": "v2"}
    for key, value in moments.items():
        codes, scale = value.codes.reshape(-1), value.scale.reshape(-1)
        pieces[f"quantized.weight.{key}.codes"] = ((6144,), torch.uint8, [(0, 6144, codes)])
        pieces[f"quantized.weight.{key}.scale"] = ((24,), torch.float32, [(0, 24, scale)])
        objects[f"quantized.weight.{key}"] = {
            "class": "torchao.optim.subclass_8bit.OptimState8bit",
            "constants": {"qmap": value.qmap},
            "context": list(value.__tensor_flatten__()[1]),
            "shape": (96, 64),
        }
    hyper = {k: v for k, v in AdamW8bit([nn.Parameter(torch.zeros(1))]).param_groups[0].items()}
    objects["param_groups"] = [{**hyper, "lr": 0.01, "params": names}]
    storage.save_pieces(tmp_path / "ck", pieces, objects)
    for partition in ("sorted_greedy", "flat"):
        fresh = nn.Linear(64, 96)
        zero = ZeroRedundancyOptimizer(fresh.parameters(), AdamW8bit, partition=partition)
        with torch.compiler.set_stance("force_eager"):  # torchao's kernels compile otherwise
            assert checkpoint.load(tmp_path / "ck", model=fresh, optimizer=zero) == "v2"
        assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
        loaded = shard_state(zero)
        for key, value in moments.items():
            got = loaded[0][key]
            assert type(got).__name__ == "OptimState8bit", (partition, key, type(got))
            assert torch.equal(got.codes.reshape(-1), value.codes.reshape(-1)), (partition, key)
            assert torch.equal(got.scale.reshape(-1), value.scale.reshape(-1)), (partition, key)
        assert torch.equal(loaded[1]["exp_avg"].reshape(-1), torch.full((96,), 0.25))
        assert float(loaded[0]["step"]) == 4.0 and zero.param_groups[0]["lr"] == 0.01


def _manifest(directory: Path, rank: int, world: int, save: str = "0123abcd") -> None:
    """A ``shared=False`` rank's manifest, written by hand: each file's size and CRC32."""
    files = {}
    for f in sorted(directory.iterdir()):
        if f.name != ".zero_functional-save" and not f.name.endswith(".json"):
            data = f.read_bytes()
            files[f.name] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    body = {"save": save, "rank": rank, "world_size": world, "files": files}
    (directory / f".rank-{rank}-of-{world}.json").write_text(json.dumps(body, indent=1))


def test_a_per_rank_directory_written_by_hand_loads_and_a_missing_part_is_refused(
    tmp_path: Path,
) -> None:
    model = train.build_model(HIDDEN)
    state = write_v1_by_hand(tmp_path / "ck", model, 0.125, "merged")
    _manifest(tmp_path / "ck", 0, 1)
    fresh = train.build_model(HIDDEN)
    opt = torch.optim.Adam(fresh.parameters())
    assert checkpoint.load(tmp_path / "ck", model=fresh, optimizer=opt) == "merged"
    assert_adam_loaded(opt, state)
    (tmp_path / "ck" / ".rank-0-of-1.json").rename(tmp_path / "ck" / ".rank-0-of-2.json")
    with pytest.raises(CheckpointError, match=r"missing rank 1's part \(ranks 0-1 of 2"):
        checkpoint.load(tmp_path / "ck", model=fresh)
    _manifest(tmp_path / "ck", 1, 2, save="ffff0000")
    with pytest.raises(CheckpointError, match="mixes parts of different saves"):
        checkpoint.load(tmp_path / "ck", model=fresh)


def test_a_background_writers_directory_and_saves_of_earlier_versions_load_and_are_replaced(
    tmp_path: Path,
) -> None:
    """The background writer leaves each rank's results file in the checkpoint; saves before
    the marker named its save left a one-line marker, and earlier ones none."""
    model = train.build_model(HIDDEN)
    cases = ("background", "one-line marker", "no marker")
    for name in cases:
        write_v1_by_hand(tmp_path / name, model, 0.125, name)
    (tmp_path / "background" / ".zero_functional-rank-0").write_bytes(
        pickle.dumps((str(tmp_path / "background.tmp-0123456789ab"), [], None))
    )
    marker = f"zero_functional.checkpoint.atomic_dir: a save to {tmp_path / 'one-line marker'}\n"
    (tmp_path / "one-line marker" / ".zero_functional-save").write_text(marker)
    (tmp_path / "no marker" / ".zero_functional-save").unlink()
    for name in cases:
        fresh = train.build_model(HIDDEN)
        assert checkpoint.load(tmp_path / name, model=fresh) == name
        checkpoint.save(tmp_path / name, model=fresh, extra="replaced")
        assert checkpoint.load(tmp_path / name, model=fresh) == "replaced"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(cases)
