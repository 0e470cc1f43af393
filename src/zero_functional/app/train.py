"""The demo training job: an MLP on scikit-learn's digits, DDP + ZeRO, then plain DDP to compare.

Every rank, spawned here (:func:`launch`) or placed by a cluster launcher (:func:`run_torchrun`),
trains with ZeRO, then with plain DDP + Adam from the same start, and compares the parameters.
The loss is scaled by ``world_size / global_batch``, so a resume at another world size continues
the same optimisation.
"""

from __future__ import annotations

import collections
import copy
import errno
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from zero_functional import checkpoint, comm
from zero_functional.app import train_file
from zero_functional.app.cluster import (
    ClusterRank,
    elastic_resume,
    restart_count,
    restart_hazard,
)
from zero_functional.app.launch import (
    TERM_GRACE_S,
    LaunchError,
    Terminated,
    process_group,
    run_ranks,
)
from zero_functional.app.plan_format import format_bytes
from zero_functional.app.preempt import EXIT_CODE, Preempted, Preemption
from zero_functional.app.rendezvous import JoinError, rendezvous
from zero_functional.app.train_options import DIGITS_TRAIN_SIZE, OURS, TrainConfig
from zero_functional.core.loads import hybrid_shape
from zero_functional.core.ownership import check_partition
from zero_functional.hooks import hook_with_zero_step, reduce_scatter_hook
from zero_functional.optimizer import ZeroRedundancyOptimizer

CHECKPOINT_FORMAT = train_file.TRAIN_FORMAT
save_checkpoint = train_file.write_train_file
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # fp16 would need a GradScaler
# Adam's ``fused`` in both runs: torch's fused CPU kernel computes the last ``numel % vector
# width`` elements of a tensor in double, so ZeRO's pieces (not whole tensors) would round apart
FUSED = False


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[Tensor]:
    """The global batches of one epoch, a permutation of ``range(n)`` fixed by seed and epoch;
    the last keeps the remainder. One epoch at a time: the number of epochs costs no memory.

    Example:
        >>> [len(b) for b in epoch_batches(5, 2, seed=2**64 - 1, epoch=999_999)]  # any seed
        [2, 2, 1]
    """
    # torch takes seeds from -2**63 to 2**64-1 and uses them modulo 2**64: reduced, all fit
    g = torch.Generator().manual_seed((seed * 100_003 + epoch) % 2**64)
    perm = torch.randperm(n, generator=g)
    return list(torch.tensor_split(perm, list(range(batch_size, n, batch_size))))


def parity_verdict(
    max_diff: float, world_size: int, reduce_on_owners: bool, compressed: str = ""
) -> str:
    """The verdict on the ZeRO run's parameters against the plain run's, after the same steps:
    exact at 1 or 2 ranks and with torch's class; at 3 or more, or ``compressed`` (what crosses
    in fewer bits), reported, not judged (the text says why).

    Example:
        >>> parity_verdict(0.0, 2, True)
        'bitwise equal'
        >>> parity_verdict(3e-8, 2, True)
        'NOT equal (max |diff| 3.0e-08, where both runs do the same arithmetic)'
    """
    if max_diff == 0:
        return "bitwise equal"
    if compressed and world_size > 1:
        return f"not compared bitwise (max |diff| {max_diff:.1e}): {compressed}, rounded once"
    if world_size >= 3 and reduce_on_owners:
        return (
            f"not compared bitwise (max |diff| {max_diff:.1e}): at {world_size} ranks gloo sums "
            "the gradients in another order for ZeRO's reduce than for DDP's all-reduce, and "
            "training amplifies the rounding; 1 or 2 ranks compare bitwise"
        )
    return f"NOT equal (max |diff| {max_diff:.1e}, where both runs do the same arithmetic)"


def rank_slice(batch: Tensor, rank: int, world_size: int) -> Tensor:
    """This rank's contiguous part of a global batch (sizes differ by at most one).

    Example:
        >>> [rank_slice(torch.arange(5), r, 2).tolist() for r in range(2)]
        [[0, 1, 2], [3, 4]]
    """
    return torch.tensor_split(batch, world_size)[rank]


def build_model(hidden: int) -> nn.Sequential:
    """The MLP: 64 pixels -> hidden -> hidden -> 10 digits.

    Example:
        >>> sum(p.numel() for p in build_model(128).parameters())
        26122
    """
    return nn.Sequential(
        nn.Linear(64, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a checkpoint of this job (:func:`.train_file.read_train`).

    Example:
        >>> load_checkpoint("no-such-checkpoint")
        Traceback (most recent call last):
        ...
        zero_functional.checkpoint.storage.CheckpointError: checkpoint no-such-checkpoint does not exist
    """
    return train_file.read_train(path, build_model)


def load_digits_split() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's 8x8 digits (1,797 images, shipped in the package), pixels in [0, 1], as
    ``(x_train, y_train, x_test, y_test)``: a fixed 80/20 split, so accuracies compare.

    Read from scikit-learn's own file without importing scikit-learn (a second per rank): its
    rows are what ``sklearn.datasets.load_digits()`` returns (``tests/unit/test_train.py``).

    Example:
        >>> x_train, y_train, x_test, y_test = load_digits_split()
        >>> tuple(x_train.shape), tuple(x_test.shape), int(y_train.max())
        ((1438, 64), (359, 64), 9)
    """
    rows = _digits_rows()
    x = rows[:, :64].float() / 16.0
    y = rows[:, 64].long()
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_test = len(y) // 5
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def _digits_rows() -> Tensor:
    """scikit-learn's ``datasets/data/digits.csv.gz``: one row per image, 64 pixels then its
    label, found through the package's spec (which runs none of its code)."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the digits are scikit-learn's: pip install 'zero_functional[demo]'"
        )
    path = Path(next(iter(spec.submodule_search_locations)), "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        rows = [[int(float(v)) for v in line.split(",")] for line in f if line.strip()]
    return torch.tensor(rows, dtype=torch.int64)


def _state_bytes(opt: Optimizer) -> int:
    """Bytes of the tensors in this rank's optimizer state (torch's ZeRO keeps them in .optim;
    the reference's main weights count, as ours keep them in the state)."""
    local = getattr(opt, "optim", opt)
    state = [v for s in local.state.values() for v in s.values() if isinstance(v, Tensor)]
    return sum(int(t.nbytes) for t in [*getattr(opt, "main", ()), *state])


class _ThroughMain(torch.optim.Adam):
    """The reference of ``main_params_dtype``: Adam on fp32 copies of every parameter, the
    gradients upcast, and the parameters the copies rounded after each step."""

    def __init__(self, params: list[Tensor], **kwargs: Any) -> None:
        self.params = params
        self.main = [p.detach().float() for p in params]
        super().__init__(self.main, **kwargs)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for m, p in zip(self.main, self.params):  # the gradients move, upcast, to the copies
            m.grad, p.grad = (None if p.grad is None else p.grad.float()), None
        super().step()
        for m, p in zip(self.main, self.params):
            p.copy_(m)


def _optimizer(
    cfg: TrainConfig, ddp: DistributedDataParallel, use_zero: bool, world_size: int
) -> Optimizer:
    """Ours (with its DDP hook), torch's ZeroRedundancyOptimizer, or the reference's Adam."""
    if use_zero and cfg.impl == "torch":
        return TorchZero(ddp.parameters(), torch.optim.Adam, lr=cfg.lr, fused=FUSED)
    if not use_zero:
        if cfg.main_params:
            return _ThroughMain(list(ddp.parameters()), lr=cfg.lr, fused=FUSED)
        return torch.optim.Adam(ddp.parameters(), lr=cfg.lr, fused=FUSED)
    mesh = None
    if cfg.shard_size is not None:  # hybrid: sharded within, replicated across
        shape = hybrid_shape(world_size, cfg.shard_size)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(),
        torch.optim.Adam,
        overlap_with_ddp=cfg.overlap,
        partition=check_partition(cfg.partition),
        lr=cfg.lr,
        fused=FUSED,
        main_params_dtype=torch.float32 if cfg.main_params else None,
        device_mesh=mesh,
        gather_dtype=_wire(cfg.gather_dtype),
    )
    wire = _wire(cfg.wire_dtype)
    if cfg.overlap:
        ddp.register_comm_hook(
            None, hook_with_zero_step(allreduce_hook, ddp, zero, wire_dtype=wire)
        )
    else:  # gradients reduced onto their owners only: with step()'s all-gather, DDP's bytes
        ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero, wire_dtype=wire))
    return zero


def _wire(name: str | None) -> torch.dtype | None:
    return None if name is None else comm.WIRE_NAMES[name]


def steps_per_epoch(batch_size: int) -> int:
    """The optimizer steps of one epoch of the digits' training split (the last batch short).

    Example:
        >>> steps_per_epoch(64), steps_per_epoch(1438)
        (23, 1)
    """
    return -(-DIGITS_TRAIN_SIZE // batch_size)


def _from_memory(cfg: TrainConfig, model: nn.Module, opt: Optimizer) -> int | None:
    """After a restart: the newest complete in-memory snapshot, if it is as new as the disk
    checkpoint (``cfg.resume``), restored into ``model`` and ``opt``; its step, or ``None``."""
    at_least = None
    if cfg.resume is not None:
        epoch, step = train_file.read_position(cfg.resume)  # its extra alone: no state read
        at_least = epoch * steps_per_epoch(cfg.batch_size) + step
    return checkpoint.restore(
        model=model, optimizer=opt, snapshot_dir=cfg.snapshot_dir, min_step=at_least
    )


def _load(model: nn.Module, opt: Optimizer, ckpt: Mapping[str, Any]) -> None:
    """Fill ``opt`` (and a sharded checkpoint's ``model``) from what :func:`load_checkpoint`
    read; a file's model went in before the optimizer copied it."""
    if "sharded" in ckpt:
        # each rank reads its own share (every rank for plain DDP's Adam), any world size
        checkpoint.load(ckpt["sharded"], model=model, optimizer=opt)
    elif ckpt:
        # torch's ZeroRedundancyOptimizer.load_state_dict sets the entries of parameters it does
        # not own to None in the dict it is given; the reference run needs them intact.
        opt.load_state_dict(copy.deepcopy(ckpt["optimizer"]))


class _Snapshots:
    """The snapshots a run asked for (``due``) and those taken (the rest were skipped: a snapshot
    still being taken on some rank), counted as their handles end; none kept past its end."""

    def __init__(self) -> None:
        self.taken = self.due = 0
        self._pending: collections.deque[checkpoint.SnapshotHandle] = collections.deque()

    def add(self, handle: checkpoint.SnapshotHandle) -> None:
        """Count ``handle`` as due, and those that ended."""
        self._pending.append(handle)
        self.due += 1
        self.count_ended()

    def count_ended(self) -> None:
        """Count the snapshots that ended as taken or not (every one, once they are settled)."""
        while self._pending and self._pending[0].done():
            self.taken += self._pending.popleft().step is not None


def _train(
    cfg: TrainConfig,
    rank: int,
    world_size: int,
    ckpt: Mapping[str, Any] | None,
    use_zero: bool,
    stop: Preemption | None = None,
    memory: bool = False,
) -> tuple[list[Tensor], dict[str, Any]]:
    """One run of the job: its final parameters, and its state bytes, step time and accuracy
    (and the snapshots taken of those due).
    ``memory``: restarted with snapshots, it looks for one first (then ``cfg.resume``)."""
    x_train, y_train, x_test, y_test = load_digits_split()
    dtype = DTYPES[cfg.dtype]
    x_train, x_test = x_train.to(dtype), x_test.to(dtype)
    per_epoch = steps_per_epoch(cfg.batch_size)
    torch.manual_seed(cfg.seed)
    ckpt = ckpt or {}
    hidden = int(ckpt["args"]["hidden"]) if ckpt else cfg.hidden
    model = build_model(hidden).to(dtype)
    if "model" in ckpt:
        model.load_state_dict(ckpt["model"])
    ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb)
    opt = _optimizer(cfg, ddp, use_zero, world_size)
    restored = _from_memory(cfg, model, opt) if memory else None
    at = None if restored is None else divmod(restored, per_epoch)
    if memory and rank == 0:
        instead = f"resuming from {cfg.resume}" if cfg.resume else "starting over"
        print(
            f"resumed from the in-memory snapshot of step {restored}"
            if restored is not None
            else f"restart {restart_count(os.environ)}: no complete in-memory snapshot; {instead}",
            flush=True,
        )
    if memory and at is None and cfg.resume is not None:
        ckpt = load_checkpoint(cfg.resume)
    _load(model, opt, ckpt)
    if ckpt or at is not None:  # this run's learning rate, not the checkpoint's
        for g in opt.param_groups:
            g["lr"] = cfg.lr
    # step 0: the epoch's end
    start, start_step = at or (int(ckpt.get("epoch", 0)), int(ckpt.get("step", 0)))
    total = (cfg.epochs - start) * per_epoch - start_step
    saves = use_zero and cfg.checkpoint is not None
    snaps = use_zero and cfg.snapshot_every is not None
    step_s, steps, samples, t_start = 0.0, 0, 0, time.perf_counter()
    snapshots = _Snapshots()
    from tqdm import tqdm

    # tqdm's default lock is a multiprocessing RLock: a named semaphore that a rank killed by a
    # signal can never unlink ("leaked semaphore" at exit); the bars of one rank need a thread lock
    tqdm.set_lock(threading.RLock())
    name, shown = ("ZeRO + DDP" if use_zero else "plain DDP"), cfg.progress and rank == 0
    bar = tqdm(total=total, desc=name, unit="step", file=sys.stderr, disable=not shown, leave=True)
    with bar:
        for epoch in range(start, cfg.epochs):  # one epoch's batches at a time
            batches = epoch_batches(len(y_train), cfg.batch_size, cfg.seed, epoch)
            for i in range(start_step if epoch == start else 0, len(batches)):
                batch = batches[i]
                idx = rank_slice(batch, rank, world_size)
                t0 = time.perf_counter()
                out = ddp(x_train[idx])
                loss = nn.functional.cross_entropy(out.float(), y_train[idx], reduction="sum")
                torch.autograd.backward(loss * (world_size / len(batch)))
                if not (use_zero and cfg.overlap):
                    opt.step()
                opt.zero_grad(set_to_none=True)
                step_s += time.perf_counter() - t0
                steps += 1
                samples += len(batch)
                bar.set_postfix(
                    loss=f"{loss.item() / max(len(idx), 1):.4f}",
                    samples_s=f"{samples / (time.perf_counter() - t_start):,.0f}",
                    refresh=False,
                )
                bar.update()
                # where the run stands: (epochs done, steps done in the next epoch)
                at = (epoch + 1, 0) if i + 1 == len(batches) else (epoch, i + 1)
                done = epoch * per_epoch + i + 1
                due = done % cfg.save_every == 0 if cfg.save_every else at[1] == 0
                if saves and (due or at == (cfg.epochs, 0)):  # and always at the end
                    train_file.write(cfg, rank, model, opt, at, hidden)
                    if cfg.save_every and rank == 0:
                        print(f"saved {cfg.checkpoint} at epoch {at[0]} step {at[1]}", flush=True)
                if snaps and done % cast(int, cfg.snapshot_every) == 0:
                    snapshots.add(
                        checkpoint.snapshot(
                            model=model, optimizer=opt, step=done, snapshot_dir=cfg.snapshot_dir
                        )
                    )
                if stop is not None and stop.agreed():  # every rank stops after this step
                    if saves and not due:
                        train_file.write(cfg, rank, model, opt, at, hidden)
                    raise Preempted(*at, saved=saves)
    if snaps:  # the job ended well: its snapshots are of no more use
        checkpoint.remove_snapshots(snapshot_dir=cfg.snapshot_dir)  # every snapshot settled
        snapshots.count_ended()
    if isinstance(opt, ZeroRedundancyOptimizer):
        opt.finish_param_sync()  # parameters final before they are read outside a forward
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    params = [p.detach().clone() for p in model.parameters()]
    stats: dict[str, Any] = {"state_bytes": _state_bytes(opt), "step_s": step_s / max(steps, 1)}
    if snaps:
        stats["snapshots"] = (snapshots.taken, snapshots.due)
    return params, {**stats, "accuracy": accuracy}


def _say(message: str) -> None:
    print(f"zero-functional train: {message}", file=sys.stderr, flush=True)


def run_job(rank: int, world_size: int, cfg: TrainConfig) -> tuple[int, str | None]:
    """Train with ZeRO (and the plain-DDP reference) on every rank of the default group, as
    :func:`~.launch.run_ranks` calls it; with a checkpoint, SIGTERM stops every rank after the
    same step, saved there (:mod:`.preempt`). Returns the exit code (0, or 143 after SIGTERM) and,
    on rank 0 if it finished, the summary."""
    if cfg.checkpoint is None:  # nothing to save: SIGTERM ends the rank at once
        return 0, _run_job(rank, world_size, cfg, None)
    with Preemption(cfg.grace_s, rank=rank, checkpoint=cfg.checkpoint) as stop:
        try:
            return 0, _run_job(rank, world_size, cfg, stop)
        except Preempted as e:
            if rank == 0:
                where = (
                    f" ({cfg.checkpoint}): --resume it to continue"
                    if e.saved
                    else f": the ZeRO run had finished, and {cfg.checkpoint} holds its end"
                )
                _say(f"every rank {e}{where}")
            return EXIT_CODE, None


def _reference_from_memory(cfg: TrainConfig) -> dict[str, Any] | None:
    """The reference run's start after a restart with snapshots: the one the ZeRO run will
    restore (read first, whole: the ZeRO run removes it when it ends), as a file's dict."""
    model = build_model(cfg.hidden)
    adam = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=FUSED)
    if (restored := _from_memory(cfg, model, adam)) is None:
        return None
    at = divmod(restored, steps_per_epoch(cfg.batch_size))
    args = {"hidden": cfg.hidden}
    state = {"model": model.state_dict(), "optimizer": adam.state_dict()}
    return {**train_file.train_extra(at[0], args), "step": at[1], **state}


def _run_job(rank: int, world_size: int, cfg: TrainConfig, stop: Preemption | None) -> str | None:
    memory = False
    if cfg.snapshot_every is not None:  # restarted, on any node: torchrun counts per agent
        restarted = restart_count(os.environ) >= 1
        memory = any(comm.all_gather_objects(restarted, comm.default_group(None)))
        if not memory:  # a first start: what the directory holds is another job's
            checkpoint.remove_snapshots(snapshot_dir=cfg.snapshot_dir)
    if memory:  # the ZeRO run looks for a snapshot first; the reference starts where it will
        ref_memory = _reference_from_memory(cfg) if cfg.reference else None
        ckpt = None
        ref_ckpt = ref_memory or (load_checkpoint(cfg.resume) if cfg.resume else None)
    else:
        ckpt = load_checkpoint(cfg.resume) if cfg.resume is not None else None
        ref_ckpt = ckpt
    if ref_ckpt is not None and "sharded" in ref_ckpt and cfg.reference:
        # the ZeRO run may overwrite the directory (--checkpoint = --resume): the reference
        # reads its start now, whole, into memory
        model = build_model(int(ref_ckpt["args"]["hidden"]))
        adam = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=FUSED)
        checkpoint.load(ref_ckpt["sharded"], model=model, optimizer=adam)
        ref_ckpt = {
            **{k: v for k, v in ref_ckpt.items() if k != "sharded"},
            "model": model.state_dict(),
            "optimizer": adam.state_dict(),
        }
    params, zero = _train(cfg, rank, world_size, ckpt, True, stop, memory)
    mine: dict[str, Any] = {"zero": zero, "ref": None, "max_diff": None}
    if cfg.reference:
        ref_params, mine["ref"] = _train(cfg, rank, world_size, ref_ckpt, False, stop)
        mine["max_diff"] = max((a - b).abs().max().item() for a, b in zip(params, ref_params))
    rows = cast(list[dict[str, Any]], comm.all_gather_objects(mine, comm.default_group(None)))
    return _summary(cfg, rows, world_size) if rank == 0 else None


def _summary(cfg: TrainConfig, rows: Sequence[Mapping[str, Any]], world_size: int) -> str:
    """The table rank 0 prints: each rank's state and step time, accuracy and the parity."""
    ours = cfg.impl == OURS
    impl = f"zero_functional, partition={cfg.partition}" if ours else "torch.distributed.optim"
    mode = "overlap_with_ddp" if cfg.overlap else "step after backward"
    if cfg.shard_size is not None:
        mode += f", mesh {world_size // cfg.shard_size} x {cfg.shard_size} (replicate x shard)"
    if cfg.dtype != "fp32":
        mode += f", {cfg.dtype} model" + (", fp32 main params" if cfg.main_params else "")
    compressed = ", ".join(
        f"{what} {name}"
        for what, name in (("gradients in", cfg.wire_dtype), ("changes in", cfg.gather_dtype))
        if name is not None
    )
    if compressed:
        mode += f", {compressed}"
    lines = [
        f"ZeroRedundancyOptimizer ({impl}, {mode}) over Adam, {world_size} rank(s), "
        f"epochs up to {cfg.epochs}",
        f"{'rank':>4}  {'optimizer state':>15}  {'unsharded Adam':>14}  {'share':>6}  "
        f"{'mean step (ZeRO)':>16}  {'mean step (DDP)':>15}",
    ]
    for r, row in enumerate(rows):
        zero, ref = row["zero"], row["ref"]
        full = format_bytes(ref["state_bytes"]) if ref else "-"
        share = f"{zero['state_bytes'] / ref['state_bytes']:6.1%}" if ref else f"{'-':>6}"
        ref_step = f"{ref['step_s'] * 1e3:12.2f} ms" if ref else f"{'-':>15}"
        lines.append(
            f"{r:>4}  {format_bytes(zero['state_bytes']):>15}  {full:>14}  {share}  "
            f"{zero['step_s'] * 1e3:13.2f} ms  {ref_step}"
        )
    zero, ref = rows[0]["zero"], rows[0]["ref"]
    ref_acc = f", plain DDP + Adam {ref['accuracy']:.4f}" if ref else ""
    lines.append(f"test accuracy: ZeRO {zero['accuracy']:.4f}{ref_acc}")
    if ref is None:
        lines.append("parity with plain DDP + torch.optim.Adam: not run (--no-reference)")
    else:
        diff = max(row["max_diff"] for row in rows)
        verdict = parity_verdict(diff, world_size, ours, compressed)
        on = " on fp32 main weights" if cfg.main_params else ""
        lines.append(f"parity with plain DDP + torch.optim.Adam{on} (seed {cfg.seed}): {verdict}")
    if "snapshots" in zero:
        taken, due = zero["snapshots"]
        lines.append(
            f"in-memory snapshots: {taken} taken of {due} due (every {cfg.snapshot_every} steps; "
            "one due while the previous was still being taken is skipped)"
        )
    if cfg.resume is not None:
        lines.append(f"resumed from: {cfg.resume}")
    if cfg.checkpoint is not None:
        lines.append(f"checkpoint: {cfg.checkpoint}")
    return "\n".join(lines)


_NO_SPACE = re.compile(
    rf"(?:rank (?P<rank>\d+): )?(?:cannot write (?P<file>\S+): )?\[Errno {errno.ENOSPC}\]"
    rf"[^'\n]*(?:'(?P<quoted>[^'\n]+)')?"
)


def disk_full(error: LaunchError, checkpoint: str | None) -> str | None:
    """One line naming the rank that found no space left on device, its file and the
    checkpoint, instead of a traceback per rank; ``None`` if no failure says ENOSPC.

    Example:
        >>> from zero_functional.app.launch import RankFailure
        >>> e = LaunchError([RankFailure(0, "raised CheckpointError: checkpoint save failed: "
        ...     "rank 1: cannot write /d/c.tmp-0/__1_0.distcp: [Errno 28] No space left on device")])
        >>> print(disk_full(e, "/d/c"))
        rank 1: no space left on device writing /d/c.tmp-0/__1_0.distcp; /d/c is unchanged: free space there or pass another --checkpoint
    """
    for failure in error.failures:
        if (found := _NO_SPACE.search(failure.reason)) is None:
            continue
        rank = found["rank"] or str(failure.rank)
        where = found["file"] or found["quoted"] or checkpoint or "the checkpoint"
        kept = f"; {checkpoint} is unchanged" if checkpoint else ""
        return (
            f"rank {rank}: {os.strerror(errno.ENOSPC).lower()} writing {where}{kept}: free "
            "space there or pass another --checkpoint"
        )
    return None


def launch(cfg: TrainConfig, nproc: int, timeout_s: float = 600.0) -> int:
    """Spawn ``nproc`` ranks (:func:`~.launch.run_ranks`), run the job and print the summary; a
    failure, SIGTERM (the ranks get ``cfg.grace_s`` more to save) or Ctrl-C is named on stderr.
    Returns 0; 1 if a rank failed or timed out; 143 after SIGTERM; 130 after Ctrl-C."""
    term_grace_s = TERM_GRACE_S + (cfg.grace_s if cfg.checkpoint is not None else 0.0)
    try:
        results = run_ranks(run_job, nproc, cfg, timeout_s=timeout_s, term_grace_s=term_grace_s)
    except Terminated as e:  # kill, timeout or a job scheduler; run_ranks stopped the ranks
        _say(e.message)
        return int(cast(int, e.code))
    except KeyboardInterrupt:  # Ctrl-C: the ranks got it too, and run_ranks stopped them
        _say(f"interrupted; its {nproc} ranks were stopped")
        return 128 + signal.SIGINT
    except LaunchError as e:
        lines = str(e).splitlines()
        if e.failures[0].reason.startswith("gave no result"):
            lines[0] += "; raise --timeout if the job is just slow"
        _say(disk_full(e, cfg.checkpoint) or "\n".join(lines))  # a full disk: one line
        return 1
    code, summary = results[0]
    if summary is not None:
        print(summary)
    return max(code for code, _ in results)


def run_torchrun(cfg: TrainConfig, where: ClusterRank) -> int:
    """Join the job's group as a cluster launcher placed this process (:mod:`.cluster`) and run
    the job; 0, 1 if ranks did not join within ``cfg.timeout`` (named on stderr), or 143 after
    SIGTERM. Other errors propagate, for the launcher to name the rank."""
    # torch's env:// rendezvous reads these two; SLURM's are derived (cluster_rank)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = where.master_addr, str(where.master_port)
    if where.rank == 0 and (hazard := restart_hazard(os.environ)) is not None:
        _say(hazard)
    quiet = cfg.snapshot_every is not None  # a snapshot may win: _train says which
    resume = elastic_resume(cfg.checkpoint, cfg.resume, os.environ, where.rank, say=not quiet)
    cfg = replace(cfg, resume=resume)
    try:
        store = rendezvous(where, cfg.timeout, os.environ)
    except JoinError as e:
        _say(f"{e}; raise --timeout if the ranks are just slow to start")
        return 1
    with process_group(
        "gloo", rank=where.rank, world_size=where.world_size, timeout_s=cfg.timeout, store=store
    ):
        code, summary = run_job(where.rank, where.world_size, cfg)
        if summary is not None:
            print(summary, flush=True)
    return code
