"""``checkpoint.save(..., blocking=False)``: the state as it was when ``save`` returned, written
behind training with every guarantee of a blocking save.

One launch of 2 ranks runs the cases that need a process group; one launch kills a rank while
its background write is under way.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zero_functional import checkpoint
from zero_functional.app.launch import LaunchError
from zero_functional.checkpoint.storage import CheckpointError
from zero_functional.optimizer import ZeroRedundancyOptimizer

from tests.dist.test_checkpoint import Net, consolidated, groups, train
from tests.helpers import run_ranks

COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "recv",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)


@contextmanager
def collectives_seen(threads: list[str]) -> Iterator[None]:
    """Record the thread of every ``torch.distributed`` collective issued in the block."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            threads.append(threading.current_thread().name)
            return fn(*args, **kwargs)

        return recorded

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@contextmanager
def disk_full_on(rank: int, me: int) -> Iterator[None]:
    """On rank ``rank``, syncing a checkpoint data file (``*.distcp``) fails as a full disk does."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if me == rank and os.readlink(f"/proc/self/fd/{fd}").endswith(".distcp"):
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        real(fd)

    os.fsync = fsync  # type: ignore[assignment]
    try:
        yield
    finally:
        os.fsync = real


def state_of(model: Net, opt: ZeroRedundancyOptimizer) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": consolidated(opt),
    }


def equal(a: object, b: object) -> bool:
    """Bitwise equality of nested dicts, lists and tensors."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))  # type: ignore[arg-type]
    return a == b


def loaded(path: str) -> tuple[dict[str, Any], Any]:
    model = Net()
    opt = ZeroRedundancyOptimizer(groups(model), torch.optim.Adam, partition="flat", lr=0.01)
    extra = checkpoint.load(path, model=model, optimizer=opt)
    return state_of(model, opt), extra


def _cases(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = Net()
    opt = ZeroRedundancyOptimizer(groups(model), torch.optim.Adam, partition="flat", lr=0.01)
    train(model, opt, rank, world_size, range(2))
    at_save = state_of(model, opt)
    first = os.path.join(root, "first")

    # the state as save() returned, though training goes on (with its collectives) meanwhile
    threads: list[str] = []
    with collectives_seen(threads):
        handle = checkpoint.save(first, model=model, optimizer=opt, extra=2, blocking=False)
        train(model, opt, rank, world_size, range(2, 4))
        handle.wait()
    out["done"] = handle.done()
    out["threads"] = sorted(set(threads))
    state, extra = loaded(first)
    out["snapshot"] = extra == 2 and equal(state, at_save)
    out["mutated"] = not equal(state_of(model, opt), at_save)

    # a second save waits for the first, blocking or not
    one = checkpoint.save(os.path.join(root, "a"), model=model, optimizer=opt, blocking=False)
    two = checkpoint.save(os.path.join(root, "b"), model=model, optimizer=opt, blocking=False)
    out["waited"] = [one.done()]
    checkpoint.save(os.path.join(root, "c"), model=model, optimizer=opt)
    out["waited"].append(two.done())
    now = state_of(model, opt)
    out["all three"] = all(equal(loaded(os.path.join(root, n))[0], now) for n in "abc")

    # rank 1's write fails: wait() raises on both ranks, naming the rank and the file
    train(model, opt, rank, world_size, range(4, 5))
    with disk_full_on(1, rank):
        failing = checkpoint.save(first, model=model, optimizer=opt, extra=3, blocking=False)
        with pytest.raises(CheckpointError) as info:
            failing.wait()
    out["wait error"] = str(info.value)
    state, extra = loaded(first)
    out["previous kept"] = extra == 2 and equal(state, at_save)
    checkpoint.save(first, model=model, optimizer=opt, extra=4)  # reported: the next save runs
    out["next save"] = loaded(first)[1]

    # a failure nobody waited for surfaces on the next save, on every rank, and only there
    with disk_full_on(1, rank):
        unwaited = checkpoint.save(first, model=model, optimizer=opt, extra=5, blocking=False)
        while not unwaited.done():  # done() reports nothing
            time.sleep(0.01)
    with pytest.raises(CheckpointError) as info:
        checkpoint.save(first, model=model, optimizer=opt, extra=6, blocking=False)
    out["next save error"] = str(info.value)
    checkpoint.save(first, model=model, optimizer=opt, extra=7, blocking=False).wait()
    out["after"] = loaded(first)[1]

    # a foreign target is refused before anything is written, on every rank
    with pytest.raises(CheckpointError) as info:
        checkpoint.save(os.path.join(root, "notes.txt"), model=model, blocking=False)
    out["refused"] = str(info.value)
    return out


def test_a_background_save_holds_the_state_at_return_waits_its_turn_and_reports_errors(
    tmp_path: Path,
) -> None:
    (tmp_path / "notes.txt").write_text("mine\n")
    for out in run_ranks(_cases, 2, str(tmp_path), timeout_s=120):
        assert out["done"] and out["snapshot"] and out["mutated"], out
        assert out["threads"] == ["MainThread"], out["threads"]  # no collective in the writer
        assert out["waited"] == [True, True] and out["all three"], out
        for key in ("wait error", "next save error"):
            assert "rank 1: cannot write " in out[key] and "__1_0.distcp" in out[key], out[key]
            assert "No space left on device" in out[key], out[key]
        assert "previous background save failed" in out["next save error"], out
        assert out["previous kept"] and out["next save"] == 4 and out["after"] == 7, out
        assert out["refused"].startswith("checkpoint save refused, nothing written: "), out
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c", "first", "notes.txt"]


def _killed_mid_write(rank: int, world_size: int, root: str) -> None:
    import signal

    model = Net()
    opt = ZeroRedundancyOptimizer(groups(model), torch.optim.Adam, partition="flat", lr=0.01)
    train(model, opt, rank, world_size, range(2))
    checkpoint.save(os.path.join(root, "ck"), model=model, optimizer=opt, extra="first")
    torch.save(state_of(model, opt), os.path.join(root, f"expected-{rank}.pt"))
    train(model, opt, rank, world_size, range(2, 3))
    real = os.fsync

    def dying(fd: int) -> None:  # rank 1's data file is written, not yet synced: killed there
        if rank == 1 and os.readlink(f"/proc/self/fd/{fd}").endswith(".distcp"):
            os.kill(os.getpid(), signal.SIGKILL)
        real(fd)

    os.fsync = dying  # type: ignore[assignment]
    checkpoint.save(os.path.join(root, "ck"), model=model, optimizer=opt, blocking=False)
    train(model, opt, rank, world_size, range(3, 6))  # training goes on until the peer is gone


def _after_the_kill(rank: int, world_size: int, root: str) -> tuple[bool, Any]:
    state, extra = loaded(os.path.join(root, "ck"))
    expected = torch.load(os.path.join(root, f"expected-{rank}.pt"), weights_only=False)
    dist.barrier()
    model = Net()
    opt = ZeroRedundancyOptimizer(groups(model), torch.optim.Adam, partition="flat", lr=0.01)
    checkpoint.save(os.path.join(root, "ck"), model=model, optimizer=opt, blocking=False).wait()
    return equal(state, expected), extra


def test_a_rank_killed_during_a_background_write_leaves_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    with pytest.raises(LaunchError, match="rank 1 was killed by signal SIGKILL"):
        run_ranks(_killed_mid_write, 2, str(tmp_path), timeout_s=120)
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith("ck.tmp-")]
    assert any(p.name.endswith(".distcp") for p in left.iterdir())  # killed mid-write
    with pytest.raises(CheckpointError, match=r"holds no checkpoint \(no \.metadata"):  # refused
        checkpoint.load(left, model=Net())
    for same, extra in run_ranks(_after_the_kill, 2, str(tmp_path), timeout_s=120):
        assert same and extra == "first"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ck", "expected-0.pt", "expected-1.pt"], names  # the leftover removed
