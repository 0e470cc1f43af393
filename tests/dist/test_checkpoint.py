"""Sharded checkpoints: save at 3 ranks, load at 1-4, across partitions, bitwise; bad files fail.

One spawn per world size runs every case (a spawn costs seconds).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_functional import checkpoint
from zero_functional.app.launch import LaunchError
from zero_functional.checkpoint.storage import CheckpointCorruptError, CheckpointError
from zero_functional.optimizer import ZeroRedundancyOptimizer

from tests.helpers import FUSED, average_grads, run_ranks

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(7, 13)
        self.norm = nn.LayerNorm(13)
        self.b = nn.Linear(13, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("calls", torch.zeros(2))  # a buffer: rank 0 writes it, all read it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.b(torch.tanh(self.norm(self.a(x)))) * self.scale


def groups(model: Net) -> list[dict[str, Any]]:
    return [
        {"params": list(model.a.parameters()) + [model.scale]},
        {"params": list(model.norm.parameters()) + list(model.b.parameters()), "lr": 0.02},
    ]


def train(model: Net, opt: Any, rank: int, world_size: int, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, 7, generator=g), torch.randn(12, 3, generator=g)
        per = 12 // world_size
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        average_grads(model, world_size)
        opt.step()


def consolidated(opt: ZeroRedundancyOptimizer) -> dict[str, Any]:
    opt.consolidate_state_dict(to=0)
    box = [opt.state_dict() if opt.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


def _save_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Train 3 steps and save (per optimizer and partition); train 3 more: the reference."""
    out: dict[str, Any] = {}
    for name, (cls, kw) in OPTIMIZERS.items():
        for partition in ("sorted_greedy", "flat"):
            model = Net()
            opt = ZeroRedundancyOptimizer(groups(model), cls, partition=partition, **kw)
            train(model, opt, rank, world_size, range(3))
            path = os.path.join(root, f"{name}-{partition}")
            checkpoint.save(path, model=model, optimizer=opt, extra={"epoch": 3, "name": name})
            before = consolidated(opt)
            train(model, opt, rank, world_size, range(3, 6))
            out[f"{name}-{partition}"] = (before, [p.detach().clone() for p in model.parameters()])
    return out


def _load_worker(
    rank: int, world_size: int, root: str, reference: dict[str, Any]
) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, (cls, kw) in OPTIMIZERS.items():
        for saved_as in ("sorted_greedy", "flat"):
            for partition in ("sorted_greedy", "flat"):
                label = f"{name} saved {saved_as} loaded {partition}"
                before, final = reference[f"{name}-{saved_as}"]
                model = Net()
                nn.init.zeros_(model.a.weight)  # something to overwrite
                opt = ZeroRedundancyOptimizer(groups(model), cls, partition=partition, **kw)
                extra = checkpoint.load(
                    os.path.join(root, f"{name}-{saved_as}"), model=model, optimizer=opt
                )
                assert extra == {"epoch": 3, "name": name}, extra
                after = consolidated(opt)
                worst = 0.0
                assert after["state"].keys() == before["state"].keys(), label
                for i, s in before["state"].items():
                    assert s.keys() == after["state"][i].keys(), label
                    for k, v in s.items():
                        assert torch.equal(v.float(), after["state"][i][k].float()), (label, i, k)
                assert after["param_groups"] == before["param_groups"], label
                train(model, opt, rank, world_size, range(3, 6))
                for a, b in zip(model.parameters(), final):
                    worst = max(worst, (a - b).abs().max().item())
                out[label] = worst
    return out


def test_save_at_three_ranks_load_at_one_to_four_under_either_partition(tmp_path: Path) -> None:
    reference = run_ranks(_save_worker, 3, str(tmp_path), timeout_s=240)[0]
    for world_size in (1, 2, 3, 4):
        for result in run_ranks(_load_worker, world_size, str(tmp_path), reference, timeout_s=240):
            for label, diff in result.items():
                # At another world size the 12 rows' gradients are summed in other groups: an
                # average is off by at most 11 u G (u = 2^-24, G the rows' mean |gradient|, about 1
                # here); SGD (lr 0.05, momentum 0.9) moves a parameter by at most 5.6 lr of that in
                # 3 steps: 1.9e-7 G. Adam's step (lr <= 0.02), a ratio of gradient statistics,
                # carries a relative change kappa x 11 u over at most twice: 3 x 2 x 0.02 x 11 u
                # kappa = 7.9e-8 kappa (kappa = sum |g_i| / |sum g_i|, the seeded data's): under
                # 1e-6 while kappa < 12.
                assert diff < 1e-6, (label, world_size, diff)


def _plain_worker(rank: int, world_size: int, root: str) -> float:
    """dcp_to_torch_save turns the directory into one file a plain torch.optim loads."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model = Net()
    opt = ZeroRedundancyOptimizer(groups(model), torch.optim.Adam, partition="flat", lr=0.01)
    train(model, opt, rank, world_size, range(3))
    checkpoint.save(os.path.join(root, "ck"), model=model, optimizer=opt)
    before = consolidated(opt)
    if rank == 0:
        dcp_to_torch_save(os.path.join(root, "ck"), os.path.join(root, "ck.pt"))
    dist.barrier()
    flat = torch.load(os.path.join(root, "ck.pt"), weights_only=True)
    plain_model = Net()
    plain_model.load_state_dict(checkpoint.model_state_dict(flat))
    plain = torch.optim.Adam(groups(plain_model), lr=0.01, **FUSED)
    plain.load_state_dict(checkpoint.optimizer_state_dict(flat))
    assert plain.state_dict()["param_groups"] == before["param_groups"]
    for i, s in before["state"].items():
        for k, v in s.items():
            assert torch.equal(plain.state_dict()["state"][i][k].float(), v.float()), (i, k)
    train(plain_model, plain, rank, world_size, range(3, 5))
    train(model, opt, rank, world_size, range(3, 5))
    return max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), plain_model.parameters())
    )


def test_plain_optimizers_read_and_write_the_same_checkpoints(tmp_path: Path) -> None:
    for diff in run_ranks(_plain_worker, 2, str(tmp_path), timeout_s=120):
        # Both sides average the same gradients (two ranks: a sum of two, either order) and run the
        # same kernels (a reference Adam is FUSED, the kernel ours runs; SGD and the rest run
        # torch's own on both), so they differ only where a piece cut off a tensor puts elements in
        # a kernel's scalar tail rather than its vector body: a few ulps of an update per step,
        # which move a parameter by one ulp of itself only where they cross a rounding boundary: at
        # most 2 steps x ulp(|p| < 2) = 2.4e-7 < 1e-6 (the scale starts at 1.5).
        assert diff < 1e-6


def _bad_worker(rank: int, world_size: int, root: str) -> dict[str, str]:
    out: dict[str, str] = {}
    model = Net()
    opt = ZeroRedundancyOptimizer(groups(model), torch.optim.Adam, partition="flat", lr=0.01)
    train(model, opt, rank, world_size, range(2))
    good = os.path.join(root, "good")
    checkpoint.save(good, model=model, optimizer=opt, extra=1)
    before_state = consolidated(opt)
    before_params = [p.detach().clone() for p in model.parameters()]

    def unchanged() -> bool:
        after = consolidated(opt)
        same_state = all(
            torch.equal(v, after["state"][i][k])
            for i, s in before_state["state"].items()
            for k, v in s.items()
        )
        return same_state and all(
            torch.equal(a, b) for a, b in zip(before_params, model.parameters())
        )

    def expect(label: str, path: str, exc: type[BaseException], **kw: Any) -> None:
        with pytest.raises(exc) as info:
            checkpoint.load(path, model=kw.get("model", model), optimizer=kw.get("optimizer", opt))
        out[label] = str(info.value)
        assert unchanged(), label

    # bytes flipped in the middle of a data file, a truncated file, a deleted file
    for case in ("flipped", "truncated", "deleted", "index"):
        bad = os.path.join(root, case)
        if rank == 0:
            import shutil

            shutil.copytree(good, bad)
            files = sorted(f for f in os.listdir(bad) if f.endswith(".distcp"))
            target = os.path.join(bad, files[-1] if case != "index" else ".metadata")
            data = bytearray(Path(target).read_bytes())
            if case in ("flipped", "index"):
                mid = len(data) // 2
                data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
                Path(target).write_bytes(bytes(data))
            elif case == "truncated":
                Path(target).write_bytes(bytes(data[: len(data) // 2]))
            else:
                os.remove(target)
        dist.barrier()
        expect(case, bad, CheckpointCorruptError)

    # a checkpoint of another model, and one missing a parameter's state
    other = nn.Sequential(nn.Linear(7, 13), nn.Linear(13, 3))
    other_opt = ZeroRedundancyOptimizer(other.parameters(), torch.optim.Adam, lr=0.01)
    for p in other.parameters():
        p.grad = torch.ones_like(p)
    other_opt.step()
    checkpoint.save(os.path.join(root, "other"), model=other, optimizer=other_opt)
    expect("other model", os.path.join(root, "other"), CheckpointError)
    expect("not a checkpoint", os.path.join(root, "missing"), CheckpointError)
    # the same model with another shape for one parameter
    wide = Net()
    wide.b = nn.Linear(13, 4)
    wide_opt = ZeroRedundancyOptimizer(groups(wide), torch.optim.Adam, lr=0.01)
    expect("shape", good, CheckpointError, model=wide, optimizer=wide_opt)
    return out


def test_bad_checkpoints_fail_on_every_rank_and_change_nothing(tmp_path: Path) -> None:
    for out in run_ranks(_bad_worker, 2, str(tmp_path), timeout_s=180):
        assert "crc32" in out["flipped"] and "corrupt" in out["flipped"], out["flipped"]
        assert "truncated" in out["truncated"], out["truncated"]
        assert "missing" in out["deleted"], out["deleted"]
        assert ".metadata" in out["index"], out["index"]
        assert "does not fit the model" in out["other model"], out["other model"]
        assert "no checkpoint directory" in out["not a checkpoint"], out["not a checkpoint"]
        assert "model.b.weight" in out["shape"] and "(4, 13)" in out["shape"], out["shape"]


def _killed_writer(rank: int, world_size: int, root: str) -> None:
    import signal

    from zero_functional.checkpoint import storage

    model = Net()
    opt = ZeroRedundancyOptimizer(groups(model), torch.optim.Adam, partition="flat", lr=0.01)
    train(model, opt, rank, world_size, range(2))
    checkpoint.save(os.path.join(root, "ck"), model=model, optimizer=opt, extra="first")
    train(model, opt, rank, world_size, range(2, 3))
    if rank == 1:  # dies while writing its file of the second save
        original = storage._ChecksummedWriter.write_data

        def dying(self: Any, plan: Any, planner: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)
            return original(self, plan, planner)

        storage._ChecksummedWriter.write_data = dying  # type: ignore[method-assign]
    checkpoint.save(os.path.join(root, "ck"), model=model, optimizer=opt, extra="second")


def _reader_then_writer(rank: int, world_size: int, root: str) -> Any:
    model = Net()
    opt = ZeroRedundancyOptimizer(groups(model), torch.optim.Adam, lr=0.01)
    extra = checkpoint.load(os.path.join(root, "ck"), model=model, optimizer=opt)
    left = sorted(os.listdir(root))  # every rank has read it before rank 0 saves
    dist.barrier()
    checkpoint.save(os.path.join(root, "ck"), model=model, optimizer=opt, extra="third")
    return extra, left


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_and_the_next_save_cleans_up(
    tmp_path: Path,
) -> None:
    with pytest.raises(LaunchError, match="rank 1 was killed by signal SIGKILL"):
        run_ranks(_killed_writer, 3, str(tmp_path), timeout_s=120)
    (left,) = [p.name for p in tmp_path.iterdir() if p.name.startswith("ck.tmp-")]
    # a user's directory that only looks like a leftover: no marker, so not ours
    (tmp_path / "ck.tmp-0123456789ab").mkdir()
    (tmp_path / "ck.tmp-0123456789ab" / "mine.txt").write_text("keep me")
    results = run_ranks(_reader_then_writer, 2, str(tmp_path), timeout_s=120)
    assert results == [("first", sorted(["ck", left, "ck.tmp-0123456789ab"]))] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ck.tmp-0123456789ab"]
    assert (tmp_path / "ck.tmp-0123456789ab" / "mine.txt").read_text() == "keep me"


def _refused_worker(rank: int, world_size: int, root: str) -> dict[str, str]:
    model = Net()
    opt = ZeroRedundancyOptimizer(groups(model), torch.optim.Adam, partition="flat", lr=0.01)
    train(model, opt, rank, world_size, range(1))
    out: dict[str, str] = {}
    for name in ("notes.txt", "project", "link"):
        with pytest.raises(CheckpointError) as info:
            checkpoint.save(os.path.join(root, name), model=model, optimizer=opt)
        out[name] = str(info.value)
    return out


def test_saving_onto_a_file_a_link_or_a_directory_of_something_else_is_refused_untouched(
    tmp_path: Path,
) -> None:
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "main.py").write_text("print()\n")
    (tmp_path / "link").symlink_to(tmp_path / "project")
    for out in run_ranks(_refused_worker, 2, str(tmp_path), start_method="fork", timeout_s=120):
        assert all(m.startswith("checkpoint save refused, nothing written: ") for m in out.values())
        assert "notes.txt is a file, not a checkpoint directory" in out["notes.txt"], out
        assert "pass another path, or remove the file" in out["notes.txt"], out
        assert "project is a directory that holds no checkpoint" in out["project"], out
        assert "link is a symbolic link" in out["link"], out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "notes.txt", "project"]
    assert (tmp_path / "notes.txt").read_text() == "my notes\n"
    assert [p.name for p in (tmp_path / "project").iterdir()] == ["main.py"]
    assert os.readlink(tmp_path / "link") == str(tmp_path / "project")
