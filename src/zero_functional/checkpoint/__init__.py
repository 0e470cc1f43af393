"""Sharded checkpoints: each rank writes what it owns, any world size reads what it will own.

A checkpoint is a directory in *model space* (:mod:`~zero_functional.checkpoint.format`): the
model's tensors and each parameter's optimizer state in its shape, by name, whatever the world
size and partition; no byte of state goes through the process group. A plain optimizer reads one
through :func:`model_state_dict` and :func:`optimizer_state_dict` (as the README shows),
``torch.distributed.checkpoint`` through :func:`stateful`. :func:`snapshot` keeps the same in
memory, each rank's share on its node and a copy on another (:mod:`.snapshots`), and
:func:`restore` reads the newest complete one back after a restart, at any world size.
"""

from __future__ import annotations

import copy
import operator
import os
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, overload

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from zero_functional import comm
from zero_functional.checkpoint import format as checkpoint_format
from zero_functional.checkpoint import snapshots, storage
from zero_functional.checkpoint.background import SaveHandle
from zero_functional.checkpoint.format import (
    FORMAT,
    Held,
    Owned,
    Request,
    Snapshot,
    model_state_dict,
    optimizer_state_dict,
)
from zero_functional.checkpoint.snapshots import SnapshotHandle
from zero_functional.checkpoint.source import Source, source
from zero_functional.checkpoint.stateful import ZeroStateful, stateful
from zero_functional.checkpoint.storage import DEFAULT_MAX_BOX_NUMEL, CheckpointError
from zero_functional.comm import ProcessGroup
from zero_functional.core.param_table import module_of
from zero_functional.ema import ShardedEMA

__all__ = [
    "FORMAT",
    "CheckpointError",
    "SaveHandle",
    "SnapshotHandle",
    "ZeroStateful",
    "load",
    "model_state_dict",
    "optimizer_state_dict",
    "remove_snapshots",
    "restore",
    "save",
    "snapshot",
    "stateful",
]


_IMMUTABLE = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)
"""Option values nothing changes in place: a checkpoint keeps them as they are."""


class _Now(NamedTuple):
    """What a checkpoint takes as it is at the call: each group's options (all but its
    parameters), the model's tensors that are not the optimizer's parameters (buffers: rank 0
    alone writes them, replicated on every rank) and an EMA's count."""

    options: list[dict[str, Any]] | None
    others: dict[str, Tensor]
    n_averaged: int | None


def _now(model: nn.Module | None, src: Source | None, rank: int, ema: ShardedEMA | None) -> _Now:
    """:class:`_Now` of this rank; options that may change in place (a tensor learning rate a
    scheduler fills) copied, numbers and tuples of them as they are."""
    options = None
    if src is not None:
        groups = src.optimizer.param_groups
        options = [
            {k: v if isinstance(v, _IMMUTABLE) else _kept(v) for k, v in g.items() if k != "params"}
            for g in groups
        ]
    others: dict[str, Tensor] = {}
    if model is not None and rank == 0:
        skip = src.table if src is not None else ()
        state = module_of(model).state_dict(keep_vars=True)
        others = {n: t for n, t in state.items() if isinstance(t, Tensor) and t not in skip}
    return _Now(options, others, None if ema is None else ema.n_averaged())


def _kept(value: Any) -> Any:
    """``value`` as it is now: itself where nothing changes it in place (a number, a tuple of
    them), else a deep copy (copy.deepcopy's walk cost a snapshot's caller 25 us of 180 for two
    groups' numbers)."""
    if isinstance(value, _IMMUTABLE):
        return value
    if isinstance(value, tuple) and all(isinstance(x, _IMMUTABLE) for x in value):
        return value
    return copy.deepcopy(value)


def _snapshot(
    model: nn.Module | None, src: Source | None, extra: Any, ema: ShardedEMA | None, now: _Now
) -> Snapshot:
    """What this rank writes: the pieces it writes, with the model's values and the EMA over
    them, and what :func:`_now` took."""
    held: list[Held] = []
    groups = None
    if src is not None:
        names, params = src.names(model), src.table.params
        states = src.state() if src.writes else {}
        for k, piece in src.pieces.items() if src.writes else ():
            p = params[k]
            values = None if model is None else p.detach().reshape(-1)[piece.start : piece.stop]
            average = None if ema is None else ema.pieces[k]
            held.append(Held(names[k], tuple(p.shape), piece, states.get(k, {}), values, average))
        options = now.options or []
        groups = [{**g, "params": n} for g, n in zip(options, src.group_names(names))]
    blockwise = src is not None and src.blockwise() is not None
    return Snapshot(held, now.others, groups, extra, now.n_averaged, blockwise)


def _first_replica_writes(write: Callable[[], object], replicate: ProcessGroup) -> None:
    """Hybrid sharding: the first replica writes each element once; the others wait for its
    verdict, so that every rank returns (or raises) when the checkpoint is committed."""
    failure: CheckpointError | None = None
    if comm.group_rank(replicate) == 0:
        try:
            write()
        except CheckpointError as e:
            failure = e
    with comm.call("checkpoint.save()", replicate):
        verdict = comm.broadcast_object(None if failure is None else str(failure), replicate)
    if failure is not None:
        raise failure
    if verdict is not None:
        raise CheckpointError(str(verdict))


@overload
def save(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | None = ...,
    optimizer: Optimizer | None = ...,
    extra: Any = ...,
    process_group: ProcessGroup | None = ...,
    max_chunk_numel: int = ...,
    ema: ShardedEMA | None = ...,
    blocking: Literal[True] = ...,
    shared: bool = ...,
) -> None: ...
@overload
def save(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | None = ...,
    optimizer: Optimizer | None = ...,
    extra: Any = ...,
    process_group: ProcessGroup | None = ...,
    max_chunk_numel: int = ...,
    ema: ShardedEMA | None = ...,
    blocking: Literal[False],
    shared: Literal[True] = ...,
) -> SaveHandle: ...
def save(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | None = None,
    optimizer: Optimizer | None = None,
    extra: Any = None,
    process_group: ProcessGroup | None = None,
    max_chunk_numel: int = DEFAULT_MAX_BOX_NUMEL,
    ema: ShardedEMA | None = None,
    blocking: bool = True,
    shared: bool = True,
) -> SaveHandle | None:
    """Write a sharded checkpoint of ``model`` and ``optimizer`` to the directory ``path``.

    Collective. Atomic: the directory is replaced once every rank has written, so a crash
    mid-save leaves the previous checkpoint. A save writing in the background is waited for.

    Args:
        model: A ``DistributedDataParallel`` or the module inside it.
        optimizer: A :class:`~zero_functional.optimizer.ZeroRedundancyOptimizer` (each rank
            writes its pieces), or a plain ``torch.optim`` one, alike on every rank (rank 0 writes).
        extra: Any picklable value, the same on every rank (``load`` returns it).
        process_group: The ranks without an optimizer to take it from (default: the world).
        max_chunk_numel: The most elements of a stored chunk: what a save needs beyond its state.
        ema: The :class:`~zero_functional.ema.ShardedEMA` of ``optimizer`` (each rank its pieces).
        blocking: ``False`` returns a :class:`SaveHandle` once the state is copied and the save
            planned; a thread writes and commits behind training, with every guarantee above,
            and its ``wait()`` (or the next ``save``) raises what it failed with. Not over a mesh.
        shared: ``False`` when the ranks share no file system (Ray Train, pods): ``path`` is
            this rank's own directory (:mod:`~zero_functional.checkpoint.storage`); ``load``
            reads the ranks' directories merged. Blocking, and not over a ``device_mesh``.

    Raises:
        CheckpointError: On every rank, naming each rank's cause; ``path`` is untouched.

    Example:
        >>> import tempfile
        >>> path, model = tempfile.mkdtemp() + "/ckpt", torch.nn.Linear(2, 1)
        >>> save(path, model=model, extra={"epoch": 3}); load(path, model=model)
        {'epoch': 3}
    """
    if model is None and optimizer is None:
        raise ValueError("save needs a model, an optimizer or both")
    if ema is not None and ema.optimizer is not optimizer:
        raise ValueError("save(ema=...) takes the ShardedEMA of the optimizer it is given")
    src = None if optimizer is None else source(optimizer, process_group)
    if src is not None:
        src.finish()
    group = process_group if src is None else src.group
    rank = comm.rank_or_zero(group)
    snapshot = _snapshot(model, src, extra, ema, _now(model, src, rank, ema))
    replicate = None if src is None else src.replicate_group
    if not shared and (not blocking or replicate is not None):
        raise ValueError(
            "save(shared=False) is blocking and takes no optimizer sharded over a "
            "device_mesh: pass blocking=True, or save to a shared directory"
        )
    if not blocking and replicate is not None:
        raise ValueError(
            "save(blocking=False) does not take an optimizer sharded over a device_mesh: "
            "its replicas wait for the first one's verdict; save with blocking=True"
        )

    def write() -> SaveHandle | None:
        return checkpoint_format.write(
            path, snapshot, group, max_box_numel=max_chunk_numel, blocking=blocking, shared=shared
        )

    if replicate is None:
        return write()
    _first_replica_writes(write, replicate)
    return None


def _request(
    model: nn.Module | None, src: Source | None, tensors: dict[str, Tensor], strict: bool, ema: bool
) -> Request:
    """What this rank reads: the model's tensors, and the pieces its optimizer reads."""
    shapes = None if model is None else {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
    if src is None:
        return Request(shapes, None, [], strict)
    names, params = src.names(model), src.table.params
    reads = [
        Owned(names[k], tuple(params[k].shape), params[k].dtype, piece, src.keeps_main(k))
        for k, piece in src.pieces.items()
    ]
    return Request(shapes, reads, src.group_names(names), strict, ema)


def load(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | None = None,
    optimizer: Optimizer | None = None,
    process_group: ProcessGroup | None = None,
    strict: bool = True,
    ema: ShardedEMA | None = None,
) -> Any:
    """Read a checkpoint :func:`save` wrote into ``model`` and ``optimizer``; return its ``extra``.

    Collective, at any world size and under either partition: each rank reads only the boxes
    of optimizer state its pieces need. Everything (keys, shapes, dtypes, checksums, the state
    against the optimizer's class) is checked before anything changes.

    Args:
        model: The model to fill (every tensor of its ``state_dict()``).
        optimizer: The :class:`~zero_functional.optimizer.ZeroRedundancyOptimizer` to fill (each
            rank reads its pieces), or a plain ``torch.optim`` optimizer (every rank reads all).
        strict: Refuse model tensors the checkpoint lacks or has in excess.
        process_group, ema: As :func:`save`'s.

    Raises:
        CheckpointError: On every rank, naming the cause; model and optimizer unchanged.

    Example:
        >>> # extra = zero_functional.checkpoint.load("ckpt", model=ddp, optimizer=zero)
    """
    snapshots.copied()  # what a snapshot in flight still copies, before this overwrites it
    tensors: dict[str, Tensor] = {}
    if model is not None:
        state = module_of(model).state_dict(keep_vars=True)
        tensors = {k: v for k, v in state.items() if isinstance(v, Tensor)}
    if ema is not None and (optimizer is None or ema.optimizer is not optimizer):
        raise ValueError("load(ema=...) takes the ShardedEMA of the optimizer it is given")
    src = None if optimizer is None else source(optimizer, process_group)
    request = _request(model, src, tensors, strict, ema is not None)
    storage.check_parts(path)  # a shared=False save: every rank's part, of one save
    contents = checkpoint_format.read(path, request, process_group if src is None else src.group)
    if src is not None:
        src.install(contents.state, contents.param_groups)
    with torch.no_grad():
        for name, value in contents.model.items():  # in the saved dtype: cast as torch does
            tensors[name].copy_(value)
    if ema is not None:
        ema.load_pieces(contents.ema, contents.ema_n_averaged)
    return contents.extra


def _steps_taken(src: Source | None) -> int | None:
    """The optimizer's count of steps, from its state's ``step`` (Adam's, AdamW's...); ``None``
    where this rank holds none."""
    counts = [e["step"] for e in src.state().values() if "step" in e] if src is not None else []
    return int(max(float(c) for c in counts)) if counts else None


def snapshot(
    *,
    model: nn.Module | None = None,
    optimizer: Optimizer | None = None,
    extra: Any = None,
    ema: ShardedEMA | None = None,
    step: int | None = None,
    snapshot_dir: str | os.PathLike[str] | None = None,
    process_group: ProcessGroup | None = None,
    max_chunk_numel: int = DEFAULT_MAX_BOX_NUMEL,
    when_busy: str = "skip",
) -> SnapshotHandle:
    """Keep this rank's share of ``model`` and ``optimizer`` in memory, and a copy of it on
    another node, behind training; :func:`restore` reads the newest complete one back.

    Collective. The share is what :func:`save` writes. A thread lays out and copies the
    optimizer's part (state, main copies, the pieces' values, the EMA) before the optimizer's
    next update, which waits for it (change them meanwhile only through the optimizer); the
    model's buffers, the groups' options and ``extra`` are taken on the caller's thread. The
    thread writes the share into ``snapshot_dir`` on this node, sends it to the next node's
    rank of the same local rank (on one node, the next rank), keeps the copy it gets, and once
    every share is on two ranks, the older snapshots go.

    One snapshot is taken at a time. A call made while an earlier one is still being taken on
    some rank is skipped on every rank (``when_busy="skip"``: training never waits for a
    snapshot, which is as new as the threads can keep up with; the handle's ``skipped`` says so
    once ``wait()`` returns), or waits for it (``"wait"``: every call is taken). The ranks agree
    in their threads, call by call: they must make the same calls.

    Args:
        model, optimizer, extra, ema, process_group, max_chunk_numel: As :func:`save`'s.
        step: The optimizer steps taken (default: its state's ``step``, as Adam keeps); the
            ranks must agree.
        snapshot_dir: This node's directory (default: :func:`~.snapshots.default_snapshot_dir`,
            ``/dev/shm/zero_functional-<run id>``); the same on a node's ranks.
        when_busy: ``"skip"`` or ``"wait"``: what a call made while the previous snapshot is
            still being taken does (a rank's choice: one rank that skips skips the call).

    Raises:
        ValueError: Neither a model nor an optimizer, an optimizer over a ``device_mesh``, a
            negative ``step``, or ``when_busy`` neither ``"skip"`` nor ``"wait"``.
        TypeError: A ``step`` that is not an integer.
        CheckpointError: A previous snapshot failed (on every rank, naming each rank's cause).

    Example:
        >>> import tempfile
        >>> where, model = tempfile.mkdtemp(), torch.nn.Linear(2, 1)
        >>> snapshot(model=model, step=5, snapshot_dir=where).wait()
        >>> restore(model=model, snapshot_dir=where)
        5
    """
    if model is None and optimizer is None:
        raise ValueError("snapshot needs a model, an optimizer or both")
    if when_busy not in ("skip", "wait"):
        raise ValueError(f"snapshot(when_busy={when_busy!r}): pass 'skip' or 'wait'")
    if step is not None and (isinstance(step, bool) or operator.index(step) < 0):
        raise ValueError(f"snapshot(step={step!r}): pass the optimizer steps taken, an int >= 0")
    if ema is not None and ema.optimizer is not optimizer:
        raise ValueError("snapshot(ema=...) takes the ShardedEMA of the optimizer it is given")
    src = None if optimizer is None else source(optimizer, process_group)
    if src is not None and src.replicate_group is not None:
        raise ValueError(
            "snapshot does not take an optimizer sharded over a device_mesh: its replicas hold "
            "the same share; save it with checkpoint.save"
        )
    group = process_group if src is None else src.group
    directory = os.fspath(snapshot_dir or snapshots.default_snapshot_dir())
    peers = snapshots.peers(group, directory)
    if when_busy == "skip" and snapshots.busy():
        return snapshots.skip(peers)
    if src is not None:
        src.finish()
    now = _now(model, src, peers.rank, ema)
    if src is None:  # the model alone: nothing holds it still, copied now
        pieces, objects = checkpoint_format.layout(_snapshot(model, None, extra, ema, now))
        return snapshots.start(pieces, objects, peers, lambda: step, max_chunk_numel)
    # taken now: what changes before the optimizer's next update (the model's buffers in
    # forward, the groups' options by a scheduler, the caller's extra); the optimizer's part
    # and its count of steps are laid out and copied by the thread while that update waits
    buffers = (
        checkpoint_format.layout(Snapshot([], now.others, None, None))[0] if now.others else {}
    )
    kept, rest = copy.deepcopy(extra), now._replace(others={})

    def later() -> tuple[storage.Pieces, dict[str, Any]]:
        return checkpoint_format.layout(_snapshot(model, src, kept, ema, rest))

    def steps() -> int | None:
        return step if step is not None else _steps_taken(src)

    # where the optimizer's tensors are: their streams' work until now, which the thread awaits
    cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    devices = {p.device for p in src.table.params if p.is_cuda} if cuda else set()
    held = snapshots.Later(later, src.hold, devices)
    return snapshots.start(buffers, {}, peers, steps, max_chunk_numel, held)


@overload
def restore(
    *,
    model: nn.Module | None = ...,
    optimizer: Optimizer | None = ...,
    ema: ShardedEMA | None = ...,
    snapshot_dir: str | os.PathLike[str] | None = ...,
    process_group: ProcessGroup | None = ...,
    strict: bool = ...,
    min_step: int | None = ...,
    return_extra: Literal[False] = ...,
) -> int | None: ...
@overload
def restore(
    *,
    model: nn.Module | None = ...,
    optimizer: Optimizer | None = ...,
    ema: ShardedEMA | None = ...,
    snapshot_dir: str | os.PathLike[str] | None = ...,
    process_group: ProcessGroup | None = ...,
    strict: bool = ...,
    min_step: int | None = ...,
    return_extra: Literal[True],
) -> tuple[int, Any] | None: ...
def restore(
    *,
    model: nn.Module | None = None,
    optimizer: Optimizer | None = None,
    ema: ShardedEMA | None = None,
    snapshot_dir: str | os.PathLike[str] | None = None,
    process_group: ProcessGroup | None = None,
    strict: bool = True,
    min_step: int | None = None,
    return_extra: bool = False,
) -> int | tuple[int, Any] | None:
    """Read the newest complete :func:`snapshot` into ``model`` and ``optimizer``, at this world
    size and partition; return its step, or ``None`` if no snapshot is complete.

    Collective. The ranks agree on the newest step whose every share is on some node (a rank's
    own or its copy; a file that fails its checksum is skipped, named on stderr), a node lacking
    a share fetches it from one that has it, and each rank reads what it owns as :func:`load`
    does. Afterwards each node keeps that snapshot alone.

    Args:
        model, optimizer, ema, process_group, strict: As :func:`load`'s.
        snapshot_dir: As :func:`snapshot`'s.
        min_step: Ignore snapshots of earlier steps (a newer disk checkpoint wins).
        return_extra: Return ``(step, extra)``, the ``extra`` the snapshot was given.

    Raises:
        CheckpointError: On every rank, as :func:`load`; model and optimizer unchanged.

    Example:
        >>> import tempfile
        >>> restore(model=torch.nn.Linear(2, 1), snapshot_dir=tempfile.mkdtemp()) is None
        True
    """
    if model is None and optimizer is None:
        raise ValueError("restore needs a model, an optimizer or both")
    src = None if optimizer is None else source(optimizer, process_group)
    group = process_group if src is None else src.group
    directory = os.fspath(snapshot_dir or snapshots.default_snapshot_dir())
    with snapshots.newest(group, directory, min_step) as found:
        if found is None:
            return None
        extra = load(
            found.view,
            model=model,
            optimizer=optimizer,
            process_group=process_group,
            strict=strict,
            ema=ema,
        )
    return (found.step, extra) if return_extra else found.step


def remove_snapshots(
    *,
    snapshot_dir: str | os.PathLike[str] | None = None,
    process_group: ProcessGroup | None = None,
) -> None:
    """Remove every snapshot in ``snapshot_dir`` on every node, once the one in flight is done
    (what a job that ended well does); collective.

    Example:
        >>> import os, tempfile
        >>> where = tempfile.mkdtemp()
        >>> snapshot(model=torch.nn.Linear(2, 1), step=1, snapshot_dir=where).wait()
        >>> remove_snapshots(snapshot_dir=where); os.path.exists(where)
        False
    """
    directory = os.fspath(snapshot_dir or snapshots.default_snapshot_dir())
    snapshots.remove(snapshots.peers(process_group, directory))
