"""In-memory snapshots (``checkpoint.snapshot`` / ``checkpoint.restore``): the share on its node,
a copy on the other, restored bitwise at the same or another world size, a lost node's shares
fetched, a corrupt file skipped by its checksum, both copies gone said by ``None``.

One launch of 2 ranks, each rank its own "node" directory, runs the cases; one launch of 3
ranks on one node restores what the 2 left, against a disk checkpoint of the same step.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zero_functional import checkpoint
from zero_functional.checkpoint import background
from zero_functional.checkpoint.storage import CheckpointError
from zero_functional.optimizer import ZeroRedundancyOptimizer

from tests.dist.test_checkpoint import Net, consolidated, groups, train
from tests.helpers import flip_byte, run_ranks


def _fresh() -> tuple[Net, ZeroRedundancyOptimizer]:
    torch.manual_seed(123)  # other values than the trained ones
    model = Net()
    return model, ZeroRedundancyOptimizer(groups(model), torch.optim.Adam, lr=0.01)


def _state(model: Net, opt: ZeroRedundancyOptimizer) -> dict[str, Any]:
    return {"params": [p.detach().clone() for p in model.parameters()], "opt": consolidated(opt)}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if any(not torch.equal(x, y) for x, y in zip(a["params"], b["params"])):
        return False
    for k, entry in a["opt"]["state"].items():
        other = b["opt"]["state"][k]
        if any(
            not torch.equal(torch.as_tensor(v), torch.as_tensor(other[n])) for n, v in entry.items()
        ):
            return False
    return a["opt"]["param_groups"] == b["opt"]["param_groups"]


def _restored(node: str, **kw: Any) -> tuple[Any, dict[str, Any] | None, list[str]]:
    model, opt = _fresh()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = checkpoint.restore(model=model, optimizer=opt, snapshot_dir=node, **kw)
    return got, _state(model, opt) if got is not None else None, [str(w.message) for w in seen]


def _two_nodes(rank: int, world_size: int, root: str) -> dict[str, Any]:
    node = os.path.join(root, f"node{rank}")
    out: dict[str, Any] = {}
    model = Net()
    opt = ZeroRedundancyOptimizer(groups(model), torch.optim.Adam, lr=0.01)
    train(model, opt, rank, world_size, range(3))
    at3 = _state(model, opt)
    extra = {"at": 3}
    handle = checkpoint.snapshot(model=model, optimizer=opt, extra=extra, snapshot_dir=node)
    # the caller's extra and the groups' options (as a scheduler's) change at once: the snapshot
    # keeps them as they were at the call (_same compares the groups)
    extra["at"] = 4
    for g in opt.param_groups:
        g["lr"] /= 2
    train(model, opt, rank, world_size, range(3, 5))  # before the thread is done: state at return
    handle.wait()
    out["step"] = handle.step
    got, state, _ = _restored(node, return_extra=True)
    out["at 3"] = got == (3, {"at": 3}) and state is not None and _same(state, at3)
    at5 = _state(model, opt)
    checkpoint.snapshot(model=model, optimizer=opt, snapshot_dir=node).wait()
    checkpoint.save(os.path.join(root, "disk5"), model=model, optimizer=opt)
    out["kept"] = sorted(os.listdir(node)), sorted(os.listdir(os.path.join(node, "step-5")))
    got, state, _ = _restored(node)
    out["at 5"] = got == 5 and state is not None and _same(state, at5)
    dist.barrier()
    if rank == 0:
        shutil.copytree(node, os.path.join(root, "kept"))  # for the launch at 3 ranks
    else:
        shutil.rmtree(node)  # the node is gone: its shares come from the other
    dist.barrier()
    got, state, _ = _restored(node)
    out["fetched"] = got == 5 and state is not None and _same(state, at5)
    out["fetched files"] = sorted(os.listdir(os.path.join(node, "step-5")))
    dist.barrier()
    if rank == 0:  # a flipped byte in rank 0's own share: its copy on the other node is read
        flip_byte(os.path.join(node, "step-5", "share-0-of-2"), 100)
    dist.barrier()
    got, state, said = _restored(node)
    out["corrupt"] = got == 5 and state is not None and _same(state, at5), said
    dist.barrier()
    for name in ("share-0-of-2", "copy-0-of-2"):  # both copies of rank 0's share gone
        shutil.rmtree(os.path.join(node, "step-5", name), ignore_errors=True)
    dist.barrier()
    out["none"] = _restored(node)[0]
    checkpoint.snapshot(model=model, optimizer=opt, snapshot_dir=node).wait()
    out["newer than"] = _restored(node, min_step=6)[0], _restored(node, min_step=5)[0]
    try:
        checkpoint.snapshot(model=model, step=rank, snapshot_dir=node).wait()
    except CheckpointError as e:
        out["disagree"] = str(e)
    checkpoint.remove_snapshots(snapshot_dir=node)
    out["removed"] = os.path.exists(node)
    return out


def _held_until_copied(rank: int, world_size: int, root: str) -> dict[str, bool]:
    """The next update waits for the snapshot thread's copy: in overlap mode (the update inside
    backward), with a plain optimizer (its step pre-hook), and an EMA's swap; each state the
    snapshot restores is the one at its call, though training went on at once."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_functional.ema import ShardedEMA
    from zero_functional.hooks import hook_with_zero_step

    def overlapped() -> tuple[Net, DDP, ZeroRedundancyOptimizer, ShardedEMA]:
        model = Net()
        ddp = DDP(model)
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=0.01
        )
        ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
        return model, ddp, zero, ShardedEMA(zero, decay=0.5)

    # the snapshot thread copies late: an update that did not wait for it would be in the copy
    copy_pieces = background.copy_pieces
    background.copy_pieces = lambda *a: (time.sleep(0.3), copy_pieces(*a))[1]  # type: ignore[assignment]
    out = {}
    node = os.path.join(root, f"held{rank}")
    torch.manual_seed(0)
    model, ddp, zero, ema = overlapped()

    def backward(step: int) -> None:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(6, 7, generator=g), torch.randn(6, 3, generator=g)
        ((ddp(x) - y) ** 2).mean().backward()

    for step in range(4):  # the first backward builds DDP's buckets: no update there
        backward(step)
    zero.finish_param_sync()
    before = _state(model, zero)
    averages = {k: t.clone() for k, t in ema.pieces.items()}
    handle = checkpoint.snapshot(model=ddp, optimizer=zero, ema=ema, snapshot_dir=node)
    backward(9)  # updates inside backward at once
    with ema.swapped_into(model):
        pass
    handle.wait()
    fresh_model, fresh_ddp, fresh, fresh_ema = overlapped()
    backward_fresh = fresh_ddp(torch.zeros(1, 7)).sum()  # its buckets, as a resumed run's
    backward_fresh.backward()
    checkpoint.restore(model=fresh_ddp, optimizer=fresh, ema=fresh_ema, snapshot_dir=node)
    out["overlap"] = _same(_state(fresh_model, fresh), before)
    restored = fresh_ema.pieces
    out["ema"] = averages.keys() == restored.keys() and all(
        torch.equal(t, restored[k]) for k, t in averages.items()
    )
    plain_model = Net()
    adam = torch.optim.Adam(plain_model.parameters(), lr=0.01)
    train(plain_model, adam, rank, world_size, range(3))
    was = [p.detach().clone() for p in plain_model.parameters()]
    handle = checkpoint.snapshot(model=plain_model, optimizer=adam, snapshot_dir=node + "p")
    train(plain_model, adam, rank, world_size, range(3, 5))
    handle.wait()
    again = Net()
    checkpoint.restore(
        model=again, optimizer=torch.optim.Adam(again.parameters()), snapshot_dir=node + "p"
    )
    out["plain"] = all(torch.equal(a, b) for a, b in zip(was, again.parameters()))
    background.copy_pieces = copy_pieces  # type: ignore[assignment]
    return {**out, **_skipped(rank, world_size, root)}


def _skipped(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A call one rank skips (its thread busy) is skipped on every rank, though the other
    waited to take it; the next is taken; a rank that cannot copy fails the call on every rank
    (the other's thread is not left waiting for it)."""
    from zero_functional.checkpoint import snapshots

    node = os.path.join(root, f"skip{rank}")
    model = Net()
    opt = ZeroRedundancyOptimizer(groups(model), torch.optim.Adam, lr=0.01)
    train(model, opt, rank, world_size, range(1))
    release, agreed = threading.Event(), snapshots._agreed_step
    copied_at_once = True
    if rank == 1:  # rank 1's thread is held before the first call's agreement
        snapshots._agreed_step = lambda p, mine: (release.wait(), agreed(p, mine))[1]  # type: ignore[assignment]
    first = checkpoint.snapshot(model=model, optimizer=opt, step=1, snapshot_dir=node)
    if rank == 1:  # busy: skipped at once
        second = checkpoint.snapshot(model=model, optimizer=opt, step=2, snapshot_dir=node)
        # what a load waits for (the calls in flight have copied what they hold) is there at
        # once: the first's copy is made, and a skipped call copies nothing
        waiter = threading.Thread(target=snapshots.copied, daemon=True)
        waiter.start()
        waiter.join(timeout=10)
        copied_at_once = not waiter.is_alive()
        snapshots._agreed_step = agreed  # type: ignore[assignment]
        release.set()
    else:  # waits for the first, then asks to take the second
        second = checkpoint.snapshot(
            model=model, optimizer=opt, step=2, snapshot_dir=node, when_busy="wait"
        )
    second.wait()
    third = checkpoint.snapshot(model=model, optimizer=opt, step=3, snapshot_dir=node)
    third.wait()  # the threads were free: taken
    out: dict[str, Any] = {
        "calls": [(h.step, h.skipped) for h in (first, second, third)],
        "copied at once": copied_at_once,
        "kept": sorted(os.listdir(node)),
        "restored": _restored(node)[0],
    }
    # calls at random moments, each rank its own pace and choice: the ranks end up with the
    # same verdict on every call, and the newest taken is what a restore reads
    pace = random.Random(rank)
    handles = []
    for step in range(10, 40):
        time.sleep(pace.uniform(0, 0.02))
        when = pace.choice(["skip", "skip", "wait"])
        handles.append(
            checkpoint.snapshot(
                model=model, optimizer=opt, step=step, snapshot_dir=node, when_busy=when
            )
        )
    handles[-1].wait()
    out["random calls"] = [(h.step, h.skipped) for h in handles]
    out["random restored"] = _restored(node)[0]
    copy = snapshots._copy
    if rank == 1:
        snapshots._copy = lambda job: (_ for _ in ()).throw(MemoryError("no room"))  # type: ignore[assignment]
    try:
        checkpoint.snapshot(model=model, optimizer=opt, step=4, snapshot_dir=node).wait()
    except CheckpointError as e:
        out["failed"] = str(e)
    snapshots._copy = copy  # type: ignore[assignment]
    checkpoint.remove_snapshots(snapshot_dir=node)
    return out


def _swapped(rank: int) -> bool:
    """``comm.swap_bytes``, the copies' transport: a ring (rank 0's message empty) and rank 0
    sending to two ranks at once; what arrives is what was sent."""
    from zero_functional import comm

    def message(src: int, dst: int) -> torch.Tensor:
        return torch.arange(src * 1000 + dst, dtype=torch.int64).to(torch.uint8)

    ring = {(r, (r + 1) % 3) for r in range(3)} | {(0, 2)}
    send = {d: message(rank, d) for s, d in ring if s == rank}
    got = comm.swap_bytes(send, sorted(s for s, d in ring if d == rank), dist.group.WORLD)
    return all(torch.equal(t, message(src, rank)) for src, t in got.items()) and len(got) == sum(
        d == rank for _, d in ring
    )


def _three_ranks(rank: int, world_size: int, root: str) -> bool:
    if not _swapped(rank):
        return False
    model, opt = _fresh()
    got = checkpoint.restore(model=model, optimizer=opt, snapshot_dir=os.path.join(root, "kept"))
    ref_model, ref_opt = _fresh()
    checkpoint.load(os.path.join(root, "disk5"), model=ref_model, optimizer=ref_opt)
    return got == 5 and _same(_state(model, opt), _state(ref_model, ref_opt))


def test_snapshots_restore_bitwise_fetch_a_lost_node_skip_a_corrupt_file_and_reshard(
    tmp_path: Path,
) -> None:
    outs = run_ranks(_two_nodes, 2, str(tmp_path), timeout_s=120)
    for rank, out in enumerate(outs):
        assert out["step"] == 3  # Adam's count
        assert out["at 3"] and out["at 5"], out
        other = 1 - rank
        # the older snapshot went once the newer was on both nodes; each node: its share and
        # a copy of the other's
        assert out["kept"] == (["step-5"], [f"copy-{other}-of-2", f"share-{rank}-of-2"]), out
        assert out["fetched"], out
        assert out["corrupt"][0], out
        assert out["none"] is None and out["newer than"] == (None, 5), out
        assert "agree on its step" in out["disagree"] and "[0, 1]" in out["disagree"], out
        assert out["removed"] is False
    # the node that was gone fetched both shares; the corrupt file was named where it was found
    assert outs[1]["fetched files"] == ["copy-0-of-2", "copy-1-of-2"]
    assert any("share-0-of-2" in line and "corrupt" in line for line in outs[0]["corrupt"][1])
    assert all(run_ranks(_three_ranks, 3, str(tmp_path), timeout_s=120))
    outs = run_ranks(_held_until_copied, 2, str(tmp_path), timeout_s=120)
    for out in outs:
        assert {k: out[k] for k in ("overlap", "ema", "plain")} == dict.fromkeys(
            ("overlap", "ema", "plain"), True
        ), out
        assert out["calls"] == [(1, False), (None, True), (3, False)], out
        assert out["copied at once"], out
        assert out["kept"] == ["step-3"] and out["restored"] == 3, out
        assert "rank 1" in out["failed"] and "MemoryError: no room" in out["failed"], out
        taken = [step for step, skipped in out["random calls"] if not skipped]
        assert taken and out["random restored"] == taken[-1], out
    calls = [out["random calls"] for out in outs]
    assert calls[0] == calls[1], calls  # every call: taken on both ranks, or skipped on both


def test_snapshot_refuses_what_it_cannot_take(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ValueError, match="a model, an optimizer or both"):
        checkpoint.snapshot(snapshot_dir=str(tmp_path))
    with pytest.raises(ValueError, match="pass 'skip' or 'wait'"):
        checkpoint.snapshot(model=Net(), snapshot_dir=str(tmp_path), when_busy="queue")
    with pytest.raises(ValueError, match="an int >= 0"):
        checkpoint.snapshot(model=Net(), snapshot_dir=str(tmp_path), step=-1)
    with pytest.raises(TypeError):
        checkpoint.snapshot(model=Net(), snapshot_dir=str(tmp_path), step=2.5)
    with pytest.raises(ValueError, match="pass snapshot_dir="):
        checkpoint.snapshot(model=Net())
