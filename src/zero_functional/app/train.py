"""The demo training job: an MLP on scikit-learn's handwritten digits, DDP + ZeRO, then plain DDP.

The job runs in every rank of a gloo process group, either spawned here on 127.0.0.1
(:func:`launch`) or joined under ``torchrun`` (:func:`run_torchrun`). It trains with
``DistributedDataParallel`` and a ``ZeroRedundancyOptimizer`` over ``torch.optim.Adam``, then, in
the same processes and from the same seed (or the same checkpoint), with plain DDP and
``torch.optim.Adam``, and reports whether the two runs end with the same parameters: both do
the same arithmetic (:data:`FUSED`), so at 1 or 2 ranks they must be bitwise equal
(:func:`parity_verdict` says why not at 3 or more).

The global batch is split across ranks and each rank's loss is scaled by
``world_size / global_batch``, so DDP's gradient average is the global batch mean exactly and a
run resumed at another world size continues the same optimisation.

Its checkpoints are :mod:`zero_functional.checkpoint` directories (or, with ``--impl torch``,
one ``torch.save`` file); their format and the checks a resume makes are
:mod:`zero_functional.checkpoint.format`'s.
"""

from __future__ import annotations

import copy
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from zero_functional import comm
from zero_functional.app.cluster import ClusterRank, elastic_resume
from zero_functional.app.disk_full import disk_full
from zero_functional.app.launch import (
    TERM_GRACE_S,
    LaunchError,
    Terminated,
    process_group,
    run_ranks,
)
from zero_functional.app.preempt import DEFAULT_GRACE_S, EXIT_CODE, Preempted, Preemption
from zero_functional.checkpoint import format as checkpoint_format
from zero_functional.checkpoint.storage import CheckpointError
from zero_functional.core.loads import hybrid_shape
from zero_functional.core.ownership import check_partition

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointError",
    "TrainConfig",
    "build_model",
    "epoch_batches",
    "format_bytes",
    "launch",
    "load_checkpoint",
    "load_digits_split",
    "parity_verdict",
    "rank_slice",
    "run_job",
    "run_torchrun",
    "save_checkpoint",
]

CHECKPOINT_FORMAT = checkpoint_format.TRAIN_FORMAT
"""The ``format`` key of the checkpoints this job writes; others are refused on resume."""

save_checkpoint = checkpoint_format.write_train_file
"""Write a single-file checkpoint's payload atomically (a crash mid-write keeps the old file)."""

Impl = Literal["zero_functional", "torch"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # fp16 would need a GradScaler


@dataclass(frozen=True)
class TrainConfig:
    """Everything a rank needs to run the job; picklable, so it travels to spawned ranks.

    Attributes:
        epochs: Total epochs; a resumed run continues up to this many.
        lr: Adam's learning rate.
        seed: Model initialisation and data order.
        batch_size: Global batch size, split across ranks.
        hidden: Width of the MLP's two hidden layers.
        overlap: Run the ZeRO step inside DDP's backward (``overlap_with_ddp``).
        checkpoint: Write a checkpoint here after every epoch, and after the step at which
            every rank agreed to stop on SIGTERM: a sharded directory
            (``zero_functional.checkpoint``), or with ``impl="torch"`` one consolidated file.
        resume: Continue from this checkpoint (a directory or a file, any world size), at the
            epoch and step it was written after.
        impl: ``"zero_functional"`` (ours) or ``"torch"`` (``torch.distributed.optim``'s).
        reference: Also run plain DDP + ``torch.optim.Adam`` and compare parameters.
        progress: Show a tqdm bar on rank 0.
        bucket_cap_mb: DDP's gradient bucket size; in overlap mode buckets are what ranks own.
        partition: ``"flat"`` (even split; the demo's) or ``"sorted_greedy"`` (torch's whole
            tensors); ignored by ``--impl torch``.
        dtype: The model's dtype, ``"fp32"`` or ``"bf16"`` (inputs cast to it, loss in fp32).
        main_params: ``"fp32"``: ours with ``main_params_dtype=torch.float32``, and the
            reference's Adam on fp32 main weights (bf16 gradients upcast, parameters rounded).
        shard_size: Hybrid sharding (ours only): the state sharded within groups of this many
            consecutive ranks and replicated across the ``world_size / shard_size`` groups, a
            ``("replicate", "shard")`` device mesh; ``None``: sharded over the whole world.
        grace_s: With ``checkpoint``: seconds from SIGTERM to the end of the save it asks for
            (:mod:`zero_functional.app.preempt`); past them the rank exits without it.
    """

    epochs: int = 10
    lr: float = 1e-3
    seed: int = 0
    batch_size: int = 64
    hidden: int = 128
    overlap: bool = False
    checkpoint: str | None = None
    resume: str | None = None
    impl: Impl = "zero_functional"
    reference: bool = True
    progress: bool = True
    bucket_cap_mb: float = 25.0
    partition: str = "flat"
    dtype: str = "fp32"
    main_params: str | None = None
    shard_size: int | None = None
    grace_s: float = DEFAULT_GRACE_S
    save_every: int | None = None

    def __post_init__(self) -> None:
        if self.save_every is not None and (self.save_every < 1 or self.checkpoint is None):
            raise ValueError(
                f"save_every must be >= 1 and needs a checkpoint, got {self.save_every} with "
                f"checkpoint {self.checkpoint!r}"
            )
        if self.dtype not in DTYPES or self.main_params not in (None, "fp32"):
            raise ValueError(
                f"dtype must be one of {', '.join(DTYPES)} and main_params None or 'fp32', got "
                f"{self.dtype!r} and {self.main_params!r}"
            )
        if self.epochs < 1 or self.batch_size < 1 or self.hidden < 1:
            raise ValueError(
                f"epochs, batch_size and hidden must be >= 1, got {self.epochs}, "
                f"{self.batch_size}, {self.hidden}"
            )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if not (self.grace_s > 0 and math.isfinite(self.grace_s)):
            raise ValueError(f"grace_s must be a positive number, got {self.grace_s}")
        if not -(2**63) <= self.seed < 2**64:
            raise ValueError(
                f"seed must be in torch.manual_seed's range, -2**63 to 2**64-1, got {self.seed}"
            )
        check_partition(self.partition)
        if self.shard_size is not None and (self.shard_size < 1 or self.impl != "zero_functional"):
            raise ValueError(
                f"shard_size must be >= 1 and needs impl 'zero_functional' (torch's class takes "
                f"no device mesh), got {self.shard_size} with impl {self.impl!r}"
            )


# ----------------------------------------------------------------------------- pure pieces


def format_bytes(n: float) -> str:
    """A byte count in binary units.

    Example:
        >>> format_bytes(512), format_bytes(1536), format_bytes(3 * 2**30)
        ('512 B', '1.5 KiB', '3.0 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[Tensor]:
    """The global batches of one epoch: a permutation of ``range(n)`` fixed by seed and epoch.

    The last batch keeps the remainder, so every sample is seen once per epoch. The job asks
    for one epoch's batches at a time, so the number of epochs costs no memory.

    Example:
        >>> [b.tolist() for b in epoch_batches(5, 2, seed=0, epoch=0)] == [
        ...     b.tolist() for b in epoch_batches(5, 2, seed=0, epoch=0)]
        True
        >>> [len(b) for b in epoch_batches(5, 2, seed=0, epoch=0)]
        [2, 2, 1]
        >>> [len(b) for b in epoch_batches(5, 2, seed=2**64 - 1, epoch=999_999)]  # any seed
        [2, 2, 1]
    """
    # torch takes seeds from -2**63 to 2**64-1 and uses them modulo 2**64: reducing here keeps
    # every (seed, epoch) that fitted before on the same permutation, and makes the rest fit
    g = torch.Generator().manual_seed((seed * 100_003 + epoch) % 2**64)
    perm = torch.randperm(n, generator=g)
    return list(torch.tensor_split(perm, list(range(batch_size, n, batch_size))))


FUSED = False
"""Adam's ``fused`` in both runs (and in torch's class): torch.optim.Adam's default arithmetic,
one float operation per element and step wherever the element sits. Torch's fused CPU kernel
computes the last ``numel % vector width`` elements of each tensor in double and the rest in
float, so ZeRO's pieces, which end where whole tensors do not, would round differently."""


def parity_verdict(max_diff: float, world_size: int, reduce_on_owners: bool) -> str:
    """The verdict on the ZeRO run's parameters against the plain run's, after the same steps.

    Both runs do the same arithmetic on every element (the same data, Adam's default kernel),
    with one exception: at 3 or more ranks, ZeRO's hooks sum each gradient onto its owner (a
    reduce) where DDP all-reduces, and gloo adds the ranks' gradients in another order for
    each. Floating-point addition is not associative, and training amplifies a difference of one
    rounding: on the demo's job, 2e-7 after 460 steps, 1e-3 after 1,840, so no tolerance holds
    for every run. At 1 or 2 ranks (a sum of two is the same either way) and with torch's class
    (which all-reduces too) the comparison is therefore exact; at 3 or more the difference is
    reported, not judged.

    Args:
        max_diff: The largest ``|parameter difference|`` over every rank and parameter.
        world_size: The ranks both runs used.
        reduce_on_owners: Whether the ZeRO run reduced gradients onto owners (ours; torch's
            class all-reduces).

    Example:
        >>> parity_verdict(0.0, 2, True)
        'bitwise equal'
        >>> parity_verdict(3e-8, 2, True)
        'NOT equal (max |diff| 3.0e-08, where both runs do the same arithmetic)'
        >>> print(parity_verdict(2e-7, 3, True))  # doctest: +NORMALIZE_WHITESPACE
        not compared bitwise (max |diff| 2.0e-07): at 3 ranks gloo sums the gradients in another
        order for ZeRO's reduce than for DDP's all-reduce, and training amplifies the rounding;
        1 or 2 ranks compare bitwise
    """
    if max_diff == 0:
        return "bitwise equal"
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
    """Read and check a checkpoint written by this job: a sharded directory, or an older file.

    For a directory (``zero_functional.checkpoint``), every stored item's checksum is verified
    and its model and optimizer state are checked against the MLP its own ``args`` describe;
    the result holds ``epoch``, ``args`` and ``sharded`` (the path). For a single file (what
    earlier versions wrote, and ``--impl torch`` writes), the zip archive's CRCs are verified and
    the result also holds ``model`` and ``optimizer``.

    Raises:
        CheckpointError: Missing, corrupt, not this job's format, or not this job's model.

    Example:
        >>> load_checkpoint("no-such-checkpoint")
        Traceback (most recent call last):
        ...
        zero_functional.checkpoint.storage.CheckpointError: checkpoint no-such-checkpoint does not exist
    """
    return checkpoint_format.read_train(path, build_model)


def load_digits_split() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's 8x8 digits (1,797 images, shipped in the package): 80/20 train/test.

    The split is fixed (seed 0), whatever ``--seed`` is, so accuracies compare across runs.

    Returns:
        ``(x_train, y_train, x_test, y_test)``, pixels scaled to [0, 1].
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_test = len(y) // 5
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


# ----------------------------------------------------------------------------- the job


def _state_bytes(opt: Optimizer) -> int:
    """Bytes of the tensors in this rank's optimizer state (torch's ZeRO keeps them in .optim;
    the reference's main weights count, as ours keep them in the state)."""
    local = getattr(opt, "optim", opt)
    return sum(int(m.nbytes) for m in getattr(opt, "main", ())) + sum(
        v.numel() * v.element_size()
        for s in local.state.values()
        for v in s.values()
        if isinstance(v, Tensor)
    )


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


@dataclass
class _RunResult:
    params: list[Tensor]
    step_s: float  # mean seconds per step
    state_bytes: int
    accuracy: float


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    # tqdm's default lock is a multiprocessing RLock: a named semaphore that a rank killed by a
    # signal can never unlink ("leaked semaphore" at exit); the bars of one rank need a thread lock
    tqdm.set_lock(threading.RLock())
    return tqdm(
        total=total, desc=desc, unit="step", file=sys.stderr, disable=not enabled, leave=True
    )


def _train(
    cfg: TrainConfig,
    rank: int,
    world_size: int,
    ckpt: Mapping[str, Any] | None,
    use_zero: bool,
    stop: Preemption | None = None,
) -> _RunResult:
    x_train, y_train, x_test, y_test = load_digits_split()
    dtype = DTYPES[cfg.dtype]
    x_train, x_test = x_train.to(dtype), x_test.to(dtype)
    torch.manual_seed(cfg.seed)
    hidden = int(ckpt["args"]["hidden"]) if ckpt is not None else cfg.hidden
    model = build_model(hidden).to(dtype)
    sharded = ckpt.get("sharded") if ckpt is not None else None
    if ckpt is not None and sharded is None:
        model.load_state_dict(ckpt["model"])
    ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb)
    opt: Optimizer
    if use_zero and cfg.impl == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

        opt = TorchZero(ddp.parameters(), torch.optim.Adam, lr=cfg.lr, fused=FUSED)
    elif use_zero:
        from zero_functional.hooks import hook_with_zero_step, reduce_scatter_hook
        from zero_functional.optimizer import ZeroRedundancyOptimizer

        mesh = None
        if cfg.shard_size is not None:  # hybrid: sharded within, replicated across
            from torch.distributed.device_mesh import init_device_mesh

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
        )
        if cfg.overlap:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
        else:
            # gradients reduced onto their owners only: with step()'s all-gather, DDP's bytes
            ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
        opt = zero
    elif cfg.main_params:
        opt = _ThroughMain(list(ddp.parameters()), lr=cfg.lr, fused=FUSED)
    else:
        opt = torch.optim.Adam(ddp.parameters(), lr=cfg.lr, fused=FUSED)
    if sharded is not None:
        from zero_functional import checkpoint

        # each rank reads its own share (every rank for plain DDP's Adam), any world size
        checkpoint.load(sharded, model=model, optimizer=opt)
    elif ckpt is not None:
        # torch's ZeroRedundancyOptimizer.load_state_dict sets the entries of parameters it does
        # not own to None in the dict it is given; the reference run needs them intact.
        opt.load_state_dict(copy.deepcopy(ckpt["optimizer"]))
    if ckpt is not None:
        for g in opt.param_groups:
            g["lr"] = cfg.lr
    start = int(ckpt["epoch"]) if ckpt is not None else 0
    start_step = int(ckpt.get("step", 0)) if ckpt is not None else 0  # 0: an epoch's end
    steps_per_epoch = -(-len(y_train) // cfg.batch_size)
    name = "ZeRO + DDP" if use_zero else "plain DDP"
    step_s, steps, samples = 0.0, 0, 0
    t_start = time.perf_counter()
    total = (cfg.epochs - start) * steps_per_epoch - start_step
    saves = use_zero and cfg.checkpoint is not None
    with _progress(total, name, cfg.progress and rank == 0) as bar:
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
                every = cfg.save_every and (epoch * len(batches) + i + 1) % cfg.save_every == 0
                if saves and (at[1] == 0 or every):
                    _write_checkpoint(cfg, rank, model, opt, at, hidden)
                    if every and rank == 0:
                        print(f"saved {cfg.checkpoint} at epoch {at[0]} step {at[1]}", flush=True)
                if stop is not None and stop.agreed():  # every rank stops after this step
                    if saves and at[1] != 0:
                        _write_checkpoint(cfg, rank, model, opt, at, hidden)
                    raise Preempted(*at, saved=saves)
    finish = getattr(opt, "finish_param_sync", None)
    if finish is not None:
        finish()  # parameters final before they are read outside a forward
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    return _RunResult(
        params=[p.detach().clone() for p in model.parameters()],
        step_s=step_s / max(steps, 1),
        state_bytes=_state_bytes(opt),
        accuracy=accuracy,
    )


def _write_checkpoint(
    cfg: TrainConfig,
    rank: int,
    model: nn.Module,
    opt: Optimizer,
    at: tuple[int, int],
    hidden: int,
) -> None:
    """Save after ``at``, (epochs done, steps done in the next epoch); a resume starts there."""
    assert cfg.checkpoint is not None
    args = {**asdict(cfg), "hidden": hidden}
    extra = {**checkpoint_format.train_extra(at[0], args), "step": at[1]}
    if cfg.impl == "zero_functional":
        from zero_functional import checkpoint

        checkpoint.save(cfg.checkpoint, model=model, optimizer=opt, extra=extra)
        return
    opt.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
    if rank == 0:
        payload = {
            **extra,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
        }
        save_checkpoint(cfg.checkpoint, payload)


def run_job(rank: int, world_size: int, cfg: TrainConfig) -> tuple[int, str | None]:
    """Train with ZeRO (and the plain-DDP reference); call on every rank of the default group.

    The arguments are in :func:`zero_functional.app.launch.run_ranks`'s order, which calls it.
    With a checkpoint, SIGTERM stops every rank after the same step, with a checkpoint there
    (:mod:`zero_functional.app.preempt`); rank 0 says so on stderr.

    Returns:
        The exit code (0, or 143 after SIGTERM) and on rank 0 the summary table (``None``
        after SIGTERM and on the other ranks).
    """
    if cfg.checkpoint is None:  # nothing to save: SIGTERM ends the rank at once, as before
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
                print(f"zero-functional train: every rank {e}{where}", file=sys.stderr)
                sys.stderr.flush()
            return EXIT_CODE, None


def _run_job(rank: int, world_size: int, cfg: TrainConfig, stop: Preemption | None) -> str | None:
    ckpt = load_checkpoint(cfg.resume) if cfg.resume is not None else None
    ref_ckpt = ckpt
    if ckpt is not None and "sharded" in ckpt and cfg.reference:
        # the ZeRO run may overwrite the directory (--checkpoint = --resume): the reference
        # reads its start now, whole, into memory
        from zero_functional import checkpoint

        model = build_model(int(ckpt["args"]["hidden"]))
        adam = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=FUSED)
        checkpoint.load(ckpt["sharded"], model=model, optimizer=adam)
        ref_ckpt = {
            **{k: v for k, v in ckpt.items() if k != "sharded"},
            "model": model.state_dict(),
            "optimizer": adam.state_dict(),
        }
    zero = _train(cfg, rank, world_size, ckpt, True, stop)
    ref = _train(cfg, rank, world_size, ref_ckpt, False, stop) if cfg.reference else None
    mine: dict[str, Any] = {
        "state_bytes": zero.state_bytes,
        "step_s": zero.step_s,
        "ref_state_bytes": ref.state_bytes if ref else None,
        "ref_step_s": ref.step_s if ref else None,
        "max_diff": (
            max((a - b).abs().max().item() for a, b in zip(zero.params, ref.params))
            if ref
            else None
        ),
    }
    rows = cast(list[dict[str, Any]], comm.all_gather_objects(mine, comm.default_group(None)))
    if rank != 0:
        return None
    return _summary(cfg, rows, zero.accuracy, ref.accuracy if ref else None, world_size)


def _summary(
    cfg: TrainConfig,
    rows: Sequence[Mapping[str, Any]],
    accuracy: float,
    ref_accuracy: float | None,
    world_size: int,
) -> str:
    impl = (
        f"zero_functional, partition={cfg.partition}"
        if cfg.impl == "zero_functional"
        else "torch.distributed.optim"
    )
    mode = "overlap_with_ddp" if cfg.overlap else "step after backward"
    if cfg.shard_size is not None:
        replicas = world_size // cfg.shard_size
        mode += f", mesh {replicas} x {cfg.shard_size} (replicate x shard)"
    if cfg.dtype != "fp32":
        mode += f", {cfg.dtype} model" + (", fp32 main params" if cfg.main_params else "")
    lines = [
        f"ZeroRedundancyOptimizer ({impl}, {mode}) over Adam, {world_size} rank(s), "
        f"epochs up to {cfg.epochs}",
        f"{'rank':>4}  {'optimizer state':>15}  {'unsharded Adam':>14}  {'share':>6}  "
        f"{'mean step (ZeRO)':>16}  {'mean step (DDP)':>15}",
    ]
    for r, row in enumerate(rows):
        full = row["ref_state_bytes"]
        share = f"{row['state_bytes'] / full:6.1%}" if full else f"{'-':>6}"
        ref_step = f"{row['ref_step_s'] * 1e3:12.2f} ms" if row["ref_step_s"] else f"{'-':>15}"
        lines.append(
            f"{r:>4}  {format_bytes(row['state_bytes']):>15}  "
            f"{format_bytes(full) if full else '-':>14}  {share}  "
            f"{row['step_s'] * 1e3:13.2f} ms  {ref_step}"
        )
    ref_acc = f", plain DDP + Adam {ref_accuracy:.4f}" if ref_accuracy is not None else ""
    lines.append(f"test accuracy: ZeRO {accuracy:.4f}{ref_acc}")
    if rows[0]["max_diff"] is None:
        lines.append("parity with plain DDP + torch.optim.Adam: not run (--no-reference)")
    else:
        diff = max(row["max_diff"] for row in rows)
        verdict = parity_verdict(diff, world_size, cfg.impl == "zero_functional")
        on = " on fp32 main weights" if cfg.main_params else ""
        lines.append(f"parity with plain DDP + torch.optim.Adam{on} (seed {cfg.seed}): {verdict}")
    if cfg.resume is not None:
        lines.append(f"resumed from: {cfg.resume}")
    if cfg.checkpoint is not None:
        lines.append(f"checkpoint: {cfg.checkpoint}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- launching


def launch(cfg: TrainConfig, nproc: int, timeout_s: float = 600.0) -> int:
    """Spawn ``nproc`` gloo ranks on 127.0.0.1 (:func:`zero_functional.app.launch.run_ranks`), run
    the job, print the summary.

    A rank that fails, dies or hangs past ``timeout_s`` ends the run: the others are stopped at
    once, and stderr names the rank that failed first and how (its traceback if it raised).

    SIGTERM (``kill``, ``timeout``, a job scheduler) and Ctrl-C stop the ranks too, with one
    line on stderr; with a checkpoint, SIGTERM gives them ``cfg.grace_s`` to save one first.

    Returns:
        The exit code: 0 on success, 1 if a rank failed or timed out, 143 after SIGTERM, 130
        after Ctrl-C.
    """
    term_grace_s = TERM_GRACE_S + (cfg.grace_s if cfg.checkpoint is not None else 0.0)
    try:
        results = run_ranks(run_job, nproc, cfg, timeout_s=timeout_s, term_grace_s=term_grace_s)
    except Terminated as e:  # kill, timeout or a job scheduler; run_ranks stopped the ranks
        print(f"zero-functional train: {e.message}", file=sys.stderr)
        return int(cast(int, e.code))
    except KeyboardInterrupt:  # Ctrl-C: the ranks got it too, and run_ranks stopped them
        print(
            f"zero-functional train: interrupted; its {nproc} ranks were stopped", file=sys.stderr
        )
        return 128 + signal.SIGINT
    except LaunchError as e:
        if (full := disk_full(e, cfg.checkpoint)) is not None:  # not 30 lines of tracebacks
            print(f"zero-functional train: {full}", file=sys.stderr)
            return 1
        lines = str(e).splitlines()
        if e.failures[0].reason.startswith("gave no result"):
            lines[0] += "; raise --timeout if the job is just slow"
        print("zero-functional train: " + "\n".join(lines), file=sys.stderr)
        return 1
    code, summary = results[0]
    if summary is not None:
        print(summary)
    return max(code for code, _ in results)


def run_torchrun(cfg: TrainConfig, where: ClusterRank) -> int:
    """Join the job's process group as ``where`` says (torchrun, SLURM or a PyTorchJob set its
    variables: :func:`zero_functional.app.cluster.cluster_rank`) and run the job.

    Returns:
        The exit code: 0, or 143 after SIGTERM (with a checkpoint saved if ``cfg`` has one);
        errors propagate so that the launcher reports the failing rank.
    """
    # torch's env:// rendezvous reads these two; SLURM's are derived (cluster_rank)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = where.master_addr, str(where.master_port)
    resume = elastic_resume(cfg.checkpoint, cfg.resume, os.environ, where.rank)
    cfg = replace(cfg, resume=resume)
    with process_group("gloo", rank=where.rank, world_size=where.world_size):
        code, summary = run_job(where.rank, where.world_size, cfg)
        if summary is not None:
            print(summary, flush=True)
    return code
