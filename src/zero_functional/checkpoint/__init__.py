"""Sharded checkpoints: each rank writes what it owns, any world size reads what it will own.

:func:`save` and :func:`load` are collective. A checkpoint is a directory in *model space*
(the model's tensors, and the optimizer state in each parameter's own shape, keyed by name), so
it depends on neither the world size nor the partition; what is stored under which key, and
the reader of each format version, are :mod:`zero_functional.checkpoint.format`'s. Here is who
writes and reads what:

* the model's parameters: each rank writes the pieces of those its optimizer owns (the writing
  is spread like the state); rank 0 writes the rest (buffers, parameters outside the
  optimizer). Every rank reads all of it (every rank needs the whole model);
* the optimizer state: a rank writes the boxes its pieces cover (never padding) and reads only
  the boxes its pieces under the new ownership need; a per-parameter scalar (Adam's ``step``)
  is written once; a plain ``torch.optim`` optimizer's is written by rank 0 and read by all.

No byte of optimizer state goes through the process group. A checkpoint that does not fit
(another model, a missing key, another shape) or whose bytes are not what was written (a
checksum per item) is a :class:`~zero_functional.checkpoint.storage.CheckpointError` on every rank, with
the model and the optimizer untouched.

To load one into a plain, unsharded optimizer::

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save("ckpt", "ckpt.pt")             # one file, in one process
    flat = torch.load("ckpt.pt", weights_only=True)
    model.load_state_dict(model_state_dict(flat))
    optimizer.load_state_dict(optimizer_state_dict(flat))

For ``torch.distributed.checkpoint`` itself (torchtitan's style, next to other ``Stateful``
objects), :func:`stateful` wraps a model and its optimizer in a ``Stateful`` whose state dict
has the layout of torch's ``get_state_dict`` (model keys; optimizer state and groups keyed by
parameter name) with each rank's pieces of optimizer state as a ``ShardedTensor``: DCP writes
each rank's share and reshards it at load, at any world size and under either partition.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed._shard.sharded_tensor.shard import Shard
from torch.optim import Optimizer

from zero_functional import comm
from zero_functional.checkpoint import background, per_rank
from zero_functional.checkpoint import format as checkpoint_format
from zero_functional.checkpoint.background import SaveHandle
from zero_functional.checkpoint.format import (
    FORMAT,
    Held,
    Owned,
    Request,
    Snapshot,
    check_groups,
    model_state_dict,
    optimizer_state_dict,
)
from zero_functional.checkpoint.storage import DEFAULT_MAX_BOX_NUMEL, CheckpointError
from zero_functional.core.classes import group_class
from zero_functional.core.layout import flat_range_boxes
from zero_functional.core.main_params import main_dtype_for
from zero_functional.core.param_table import ParamTable
from zero_functional.core.partition import Piece
from zero_functional.core.piece_state import is_elementwise
from zero_functional.ema import MODULE_PREFIX, N_AVERAGED_KEY, ShardedEMA
from zero_functional.functional import update_kind
from zero_functional.functional.registry import update_block
from zero_functional.optimizer import ZeroRedundancyOptimizer
from zero_functional.shell.steppers import hyperparameters, probe_state

__all__ = [
    "FORMAT",
    "CheckpointError",
    "SaveHandle",
    "ZeroStateful",
    "load",
    "model_state_dict",
    "optimizer_state_dict",
    "save",
    "stateful",
]


def _module(model: nn.Module) -> nn.Module:
    """The wrapped module of a ``DistributedDataParallel``, else the model itself."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def _params(optimizer: Optimizer) -> list[Tensor]:
    """The optimizer's parameters in ``torch.optim``'s order (the groups', concatenated): ours
    keep their table; a plain ``torch.optim`` optimizer's is built from its groups."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return list(optimizer.param_table.params)
    return list(ParamTable.of(optimizer.param_groups).params)


def _names(model: nn.Module | None, optimizer: Optimizer) -> list[str]:
    """Each of the optimizer's parameters' name in the model (its index without a model)."""
    table = (
        optimizer.param_table
        if isinstance(optimizer, ZeroRedundancyOptimizer)
        else ParamTable.of(optimizer.param_groups)
    )
    try:
        return table.names(model)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _group_names(optimizer: Optimizer, names: list[str]) -> list[list[str]]:
    """Each group's parameters' names."""
    return [names[a : a + n] for a, n in _spans(optimizer)]


def _group(
    optimizer: Optimizer | None, process_group: dist.ProcessGroup | None
) -> dist.ProcessGroup | None:
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.process_group
    return process_group


def _shards(optimizer: Optimizer) -> tuple[dict[int, Piece], dict[int, Any]]:
    """The pieces this rank writes and reads, and their state: a ZeroRedundancyOptimizer's own;
    a plain optimizer's (the same on every rank) all whole, written by rank 0, read by all."""
    params = _params(optimizer)
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        owned = {s.param: s for s in optimizer.ownership.owned(optimizer.rank)}
        return owned, {k: state for k, (_, state) in optimizer.shard_state().items()}
    whole = {k: Piece(k, 0, p.numel(), p.numel()) for k, p in enumerate(params)}
    state = {k: optimizer.state[p] for k, p in enumerate(params) if optimizer.state.get(p)}
    return whole, state


def _spans(optimizer: Optimizer) -> list[tuple[int, int]]:
    """Each group's first global index and length."""
    out, start = [], 0
    for g in optimizer.param_groups:
        out.append((start, len(g["params"])))
        start += len(g["params"])
    return out


def _blockwise(optimizer: Optimizer) -> str | None:
    """The name of the first class among ``optimizer``'s groups' that quantizes its state in
    blocks (torchao's low-bit AdamWs), else ``None``: the same on every rank."""
    default = (
        optimizer.optimizer_class
        if isinstance(optimizer, ZeroRedundancyOptimizer)
        else type(optimizer)
    )
    for g in optimizer.param_groups:
        cls = group_class(g, default) if isinstance(optimizer, ZeroRedundancyOptimizer) else default
        if update_block(cls, {**optimizer.defaults, **g}) > 1:
            return cls.__name__
    return None


def _snapshot(
    model: nn.Module | None,
    optimizer: Optimizer | None,
    extra: Any,
    rank: int,
    ema: ShardedEMA | None = None,
) -> Snapshot:
    """What this rank writes: the pieces it owns (every piece on rank 0 for a plain
    optimizer), with the model's values and the EMA over them; rank 0 adds the model's other
    tensors."""
    held: list[Held] = []
    groups = None
    in_optimizer: set[Tensor] = set()
    if optimizer is not None:
        names, params = _names(model, optimizer), _params(optimizer)
        owned, states = _shards(optimizer)
        if isinstance(optimizer, ZeroRedundancyOptimizer) or rank == 0:
            for k, piece in owned.items():
                p = params[k]
                values = None if model is None else p.detach().reshape(-1)[piece.start : piece.stop]
                average = None if ema is None else ema.pieces[k]
                held.append(
                    Held(names[k], tuple(p.shape), piece, states.get(k, {}), values, average)
                )
        in_optimizer = set(params)
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": group_names}
            for g, group_names in zip(optimizer.param_groups, _group_names(optimizer, names))
        ]
    others: dict[str, Tensor] = {}
    if model is not None and rank == 0:  # replicated on every rank: one writer
        for name, t in _module(model).state_dict(keep_vars=True).items():
            if isinstance(t, Tensor) and t not in in_optimizer:
                others[name] = t
    n_averaged = None if ema is None else ema.n_averaged()
    blockwise = optimizer is not None and _blockwise(optimizer) is not None
    return Snapshot(held, others, groups, extra, n_averaged, blockwise)


def _first_replica_writes(write: Callable[[], None], replicate: dist.ProcessGroup) -> None:
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
    process_group: dist.ProcessGroup | None = ...,
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
    process_group: dist.ProcessGroup | None = ...,
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
    process_group: dist.ProcessGroup | None = None,
    max_chunk_numel: int = DEFAULT_MAX_BOX_NUMEL,
    ema: ShardedEMA | None = None,
    blocking: bool = True,
    shared: bool = True,
) -> SaveHandle | None:
    """Write a sharded checkpoint of ``model`` and ``optimizer`` to the directory ``path``.

    Collective: call it on every rank. Atomic: the directory is replaced only once every rank
    has written, so a crash mid-save leaves the previous checkpoint readable. A save still
    writing in the background is waited for first, never interleaved.

    Args:
        path: The checkpoint directory.
        model: The model (a ``DistributedDataParallel`` or the module inside it).
        optimizer: A :class:`~zero_functional.optimizer.ZeroRedundancyOptimizer` (each rank
            writes its pieces), or a plain ``torch.optim`` optimizer holding the same state
            on every rank (rank 0 writes it).
        extra: Any picklable value, the same on every rank (``load`` returns it).
        process_group: The ranks without an optimizer to take it from (default: the world).
        max_chunk_numel: No stored chunk has more elements: the memory a save needs beyond
            what the rank already holds.
        ema: A :class:`~zero_functional.ema.ShardedEMA` of ``optimizer``: each rank
            writes its pieces' averages.
        blocking: ``False`` returns once the state is copied (to pinned host memory from a
            GPU) and the save planned, with a :class:`SaveHandle` (``.wait()``, ``.done()``);
            a thread writes and commits behind training, with every guarantee above. Not
            with an optimizer sharded over a ``device_mesh``.
        shared: ``False`` when the ranks share no file system (Ray Train, pods): ``path`` is
            this rank's own directory, where it writes only its files, its manifest and its
            own commit (:mod:`~zero_functional.checkpoint.per_rank`); ``load`` reads the
            ranks' directories merged into one. Blocking, and not over a ``device_mesh``.

    Returns:
        ``None`` when blocking; else the write's :class:`SaveHandle`, whose ``wait()`` raises
        what the write failed with (so does the next ``save``, if nothing reported it).

    Raises:
        CheckpointError: On every rank, naming each rank's cause; ``path`` is untouched.

    Example:
        >>> # zero_functional.checkpoint.save("ckpt", model=ddp, optimizer=zero, extra={"epoch": 3})
        >>> # handle = zero_functional.checkpoint.save("ckpt", ..., blocking=False); handle.wait()
    """
    if model is None and optimizer is None:
        raise ValueError("save needs a model, an optimizer or both")
    zero = optimizer if isinstance(optimizer, ZeroRedundancyOptimizer) else None
    if ema is not None and (zero is None or ema.optimizer is not zero):
        raise ValueError("save(ema=...) takes the ShardedEMA of the optimizer it is given")
    if zero is not None:
        zero.finish_param_sync()
    group = _group(optimizer, process_group)
    snapshot = _snapshot(model, optimizer, extra, comm.rank_or_zero(group), ema)

    if not shared:
        if not blocking or (zero is not None and zero.replicate_group is not None):
            raise ValueError(
                "save(shared=False) is blocking and takes no optimizer sharded over a "
                "device_mesh: pass blocking=True, or save to a shared directory"
            )
        background.settle(group)
        pieces, objects = checkpoint_format.layout(snapshot)
        per_rank.save_pieces(path, pieces, objects, group, max_box_numel=max_chunk_numel)
        return None
    if not blocking:
        if zero is not None and zero.replicate_group is not None:
            raise ValueError(
                "save(blocking=False) does not take an optimizer sharded over a device_mesh: "
                "its replicas wait for the first one's verdict; save with blocking=True"
            )
        return checkpoint_format.write(
            path, snapshot, group, max_box_numel=max_chunk_numel, blocking=False
        )

    def write() -> None:
        checkpoint_format.write(path, snapshot, group, max_box_numel=max_chunk_numel)

    if zero is None or zero.replicate_group is None:
        write()
    else:
        _first_replica_writes(write, zero.replicate_group)
    return None


def _request(
    model: nn.Module | None,
    optimizer: Optimizer | None,
    tensors: dict[str, Tensor],
    strict: bool,
    ema: bool = False,
) -> Request:
    """What this rank reads: the model's tensors, and the pieces its optimizer owns."""
    shapes = None if model is None else {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
    if optimizer is None:
        return Request(shapes, None, [], strict)
    names, params = _names(model, optimizer), _params(optimizer)
    main = optimizer.main_params_dtype if isinstance(optimizer, ZeroRedundancyOptimizer) else None
    reads = [
        Owned(
            names[k],
            tuple(params[k].shape),
            params[k].dtype,
            piece,
            keeps_main=main_dtype_for(params[k].dtype, main) is not None,
        )
        for k, piece in _shards(optimizer)[0].items()
    ]
    return Request(shapes, reads, _group_names(optimizer, names), strict, ema)


def _state_dict(optimizer: Optimizer, contents: checkpoint_format.Contents) -> dict[str, Any]:
    """What was read, as a plain optimizer's ``state_dict``."""
    groups = [
        {**g, "params": list(range(a, a + n))}
        for g, (a, n) in zip(contents.param_groups, _spans(optimizer))
    ]
    return {"state": contents.state, "param_groups": groups}


def load(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | None = None,
    optimizer: Optimizer | None = None,
    process_group: dist.ProcessGroup | None = None,
    strict: bool = True,
    ema: ShardedEMA | None = None,
) -> Any:
    """Read a checkpoint :func:`save` wrote into ``model`` and ``optimizer``; return its extra.

    Collective. Works at any world size and under either partition: each rank reads only the
    boxes of optimizer state its pieces need. Everything is checked (keys, shapes, dtypes,
    checksums, the optimizer's state against its class) before anything changes.

    Args:
        path: The checkpoint directory.
        model: The model to fill (every tensor of its ``state_dict()``).
        optimizer: The :class:`~zero_functional.optimizer.ZeroRedundancyOptimizer` to fill (each
            rank reads its pieces), or a plain ``torch.optim`` optimizer (every rank reads all).
        process_group: The ranks without an optimizer to take it from (default: the world).
        strict: Refuse model tensors the checkpoint lacks or has in excess.
        ema: The :class:`~zero_functional.ema.ShardedEMA` of ``optimizer`` to fill (each
            rank reads its pieces' averages; a checkpoint saved without one is refused).

    Returns:
        The ``extra`` given to :func:`save`.

    Raises:
        CheckpointError: On every rank, naming the cause; model and optimizer unchanged.

    Example:
        >>> # extra = zero_functional.checkpoint.load("ckpt", model=ddp, optimizer=zero)
    """
    tensors: dict[str, Tensor] = {}
    if model is not None:
        state = _module(model).state_dict(keep_vars=True)
        tensors = {k: v for k, v in state.items() if isinstance(v, Tensor)}
    if ema is not None and (optimizer is None or ema.optimizer is not optimizer):
        raise ValueError("load(ema=...) takes the ShardedEMA of the optimizer it is given")
    request = _request(model, optimizer, tensors, strict, ema is not None)
    per_rank.check_parts(path)  # a shared=False save: every rank's part, of one save
    contents = checkpoint_format.read(path, request, _group(optimizer, process_group))
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.finish_param_sync()
        optimizer.load_shard_state(contents.state, contents.param_groups, copy=False)
    elif optimizer is not None:
        optimizer.load_state_dict(_state_dict(optimizer, contents))
    with torch.no_grad():
        for name, value in contents.model.items():  # in the saved dtype: cast as torch does
            tensors[name].copy_(value)
    if ema is not None:
        ema.load_pieces(contents.ema, contents.ema_n_averaged)
    return contents.extra


# ------------------------------------------------------------------------------ DCP Stateful


def _sharded(
    local: Tensor,
    shape: torch.Size,
    holders: Sequence[tuple[int, Piece]],
    zero: ZeroRedundancyOptimizer,
) -> ShardedTensor:
    """``local`` (this rank's flat piece of a tensor of ``shape``) as a ShardedTensor whose
    shards are the row-major boxes of every holder's piece: what DCP writes and reshards."""
    group = zero.process_group
    device = str(local.device)
    metas: list[ShardMetadata] = []
    shards: list[Shard] = []
    for rank, piece in holders:
        placement = f"rank:{comm.global_rank(group, rank)}/{device}"
        for (offsets, sizes), first in flat_range_boxes(shape, piece.start, piece.stop):
            meta = ShardMetadata(list(offsets), list(sizes), placement)
            metas.append(meta)
            if rank == zero.rank:
                a = first - piece.start
                shards.append(Shard(local[a : a + math.prod(sizes)].view(sizes), meta))
    properties = TensorProperties(dtype=local.dtype, pin_memory=local.is_pinned())
    metadata = ShardedTensorMetadata(metas, shape, properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, metadata, process_group=group
    )


class ZeroStateful:
    """A model and its :class:`~zero_functional.optimizer.ZeroRedundancyOptimizer` as one
    ``torch.distributed.checkpoint`` ``Stateful``; made by :func:`stateful`.

    ``state_dict()`` has the layout of torch's
    ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)``::

        {"model": model.state_dict(),          # replicated: DCP writes each tensor once
         "optimizer": {"state": {name: {"exp_avg": ShardedTensor, "step": tensor, ...}},
                       "param_groups": [{"lr": ..., "params": [name, ...]}, ...]}}

    Each elementwise state value is a ``ShardedTensor`` in its parameter's shape whose local
    shards are this rank's pieces (as row-major boxes), so DCP writes every element once, by
    its owner, and at load reads into each rank's pieces under the loading optimizer's
    ownership whatever world size and partition wrote them. Per-parameter values (Adam's
    ``step``, the same on every rank holding a piece) are written once.

    Loading builds its template from the optimizer's state, or, before its first step, from
    the keys one step of its class makes (every parameter that requires grad gets them), as
    zeros: a save before the first step writes those zeros (``step`` 0; never memory no one
    wrote), which load as a fresh Adam's state. As DCP does with torch's own state dicts, ``dcp.load`` writes into the model's
    parameters and into the state it was given, then :meth:`load_state_dict` installs the
    optimizer state (checked against the class's own state, collective).
    """

    def __init__(
        self, model: nn.Module, optimizer: ZeroRedundancyOptimizer, ema: ShardedEMA | None = None
    ) -> None:
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            raise TypeError(
                f"stateful() takes a zero_functional ZeroRedundancyOptimizer, got "
                f"{type(optimizer).__name__}: for a plain torch.optim optimizer use "
                "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)"
            )
        if optimizer.replicate_group is not None:  # every replica would offer the same shards
            raise ValueError(
                "stateful() does not take an optimizer sharded over a device_mesh yet: its "
                "replicas would each write the same shards; use zero_functional.checkpoint."
                "save/load, which the first replica writes and every rank reads"
            )
        if ema is not None and ema.optimizer is not optimizer:
            raise ValueError("stateful(ema=...) takes the ShardedEMA of the optimizer it is given")
        blockwise = _blockwise(optimizer)
        if blockwise is not None:  # DCP would cut its codes in the parameter's shape
            raise ValueError(
                f"stateful() does not take an optimizer whose state is block-wise quantized "
                f"({blockwise}): use zero_functional.checkpoint.save/load, which store its "
                "codes and scales on its blocks and reshard them at any world size"
            )
        self.model = model
        self.optimizer = optimizer
        self.ema = ema
        self._names = _names(model, optimizer)  # checks that the parameters are the model's
        self._flat: dict[tuple[str, str], tuple[ShardedTensor, Tensor]] = {}

    def state_dict(self) -> dict[str, Any]:
        """The model's state and the optimizer's groups and this rank's state; no copies."""
        zero = self.optimizer
        zero.finish_param_sync()  # the model's parameters are read (or written) next
        out = {
            "model": _module(self.model).state_dict(),
            "optimizer": {
                "state": self._optimizer_state(),
                "param_groups": [
                    {**hyperparameters(g), "params": names}
                    for g, names in zip(zero.param_groups, _group_names(zero, self._names))
                ],
            },
        }
        if self.ema is not None:
            out["ema"] = self._ema_state(self.ema)
        return out

    def _ema_state(self, ema: ShardedEMA) -> dict[str, Any]:
        """The EMA in ``AveragedModel``'s layout, each average a ShardedTensor of the pieces."""
        zero, params = self.optimizer, _params(self.optimizer)
        out: dict[str, Any] = {
            MODULE_PREFIX + self._names[k]: _sharded(
                flat, params[k].shape, zero.ownership.holders(k), zero
            )
            for k, flat in ema.pieces.items()
        }
        out[N_AVERAGED_KEY] = torch.tensor(ema.n_averaged(), dtype=torch.long)
        return out

    def _optimizer_state(self) -> dict[str, dict[str, Any]]:
        zero = self.optimizer
        params = _params(zero)
        group_of = [i for i, (_, n) in enumerate(_spans(zero)) for _ in range(n)]
        held = zero.shard_state()
        probes: dict[tuple[int, tuple[int, ...]], dict[str, Any] | None] = {}
        self._flat = {}
        out: dict[str, dict[str, Any]] = {}
        for piece in zero.ownership.owned(zero.rank):
            k, p = piece.param, params[piece.param]
            numel = piece.stop - piece.start
            probed = numel  # how many elements the state's elementwise values hold
            if k in held:
                values, fresh = held[k][1], False
            elif p.requires_grad:  # a template: the keys one step of the group's class makes
                group = zero.param_groups[group_of[k]]
                cls = group_class(group, zero.optimizer_class)
                # a per-tensor class (Muon) in the parameter's own shape; others on 2 elements
                shape = (2,) if update_kind(cls) == "elementwise" else tuple(p.shape)
                if (group_of[k], shape) not in probes:
                    probes[group_of[k], shape] = probe_state(cls, group, {}, shape)
                probe = probes[group_of[k], shape]
                if probe is None:
                    continue
                values, fresh, probed = probe, True, math.prod(shape)
            else:
                continue
            entry: dict[str, Any] = {}
            for key, v in values.items():
                if isinstance(v, Tensor) and is_elementwise(v, probed):
                    if fresh:
                        dtype = p.dtype if v.is_floating_point() or v.is_complex() else v.dtype
                        flat = torch.zeros(numel, dtype=dtype, device=p.device)
                    else:
                        flat = v.detach().reshape(-1)
                    st = _sharded(flat, p.shape, zero.ownership.holders(k), zero)
                    self._flat[(self._names[k], key)] = (st, flat)
                    entry[key] = st
                elif isinstance(v, Tensor):
                    entry[key] = torch.zeros_like(v) if fresh else v
                else:
                    entry[key] = None if fresh else v
            out[self._names[k]] = entry
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Install what ``dcp.load`` read into :meth:`state_dict`'s dict; call it on every rank.

        Raises:
            CheckpointError: The checkpoint's groups list other parameters (another model).
        """
        zero = self.optimizer
        _module(self.model).load_state_dict(state_dict["model"])
        saved = state_dict["optimizer"]
        groups = check_groups(saved["param_groups"], _group_names(zero, self._names))
        index = {name: k for k, name in enumerate(self._names)}
        params = _params(zero)
        owned = {s.param: s for s in zero.ownership.owned(zero.rank)}
        state: dict[int, dict[str, Any]] = {}
        for name, entry in saved["state"].items():
            k = index[name]
            piece, p = owned[k], params[k]
            whole = piece.is_whole
            values: dict[str, Any] = {}
            for key, v in entry.items():
                if isinstance(v, ShardedTensor):
                    made = self._flat.get((name, key))
                    if made is not None and made[0] is v:
                        flat = made[1]  # the buffer DCP read into, through the shards' views
                    else:
                        flat = torch.cat([s.tensor.reshape(-1) for s in v.local_shards()])
                    values[key] = flat.view(p.shape) if whole else flat
                else:
                    values[key] = v
            state[k] = values
        self._flat = {}
        zero.load_shard_state(state, groups, copy=False)
        if self.ema is not None:
            saved_ema = state_dict["ema"]
            self.ema.load_pieces(
                {
                    index[key[len(MODULE_PREFIX) :]]: torch.cat(
                        [s.tensor.reshape(-1) for s in v.local_shards()]
                    )
                    for key, v in saved_ema.items()
                    if isinstance(v, ShardedTensor)
                },
                int(saved_ema[N_AVERAGED_KEY]),
            )


def stateful(
    model: nn.Module, optimizer: ZeroRedundancyOptimizer, ema: ShardedEMA | None = None
) -> ZeroStateful:
    """A ``torch.distributed.checkpoint`` ``Stateful`` of ``model`` and its ZeRO ``optimizer``.

    Each rank writes its share of the optimizer state; any world size and either partition
    loads it (see :class:`ZeroStateful`). Call ``dcp.save``/``dcp.load`` on every rank.

    Args:
        model: The model (a ``DistributedDataParallel`` or the module inside it).
        optimizer: The :class:`~zero_functional.optimizer.ZeroRedundancyOptimizer` over its
            parameters.
        ema: Its :class:`~zero_functional.ema.ShardedEMA`, saved under ``"ema"`` in
            ``AveragedModel``'s layout, each average sharded as the state is.

    Raises:
        TypeError: ``optimizer`` is not a ZeroRedundancyOptimizer.
        ValueError: It is sharded over a ``device_mesh``, or a class of its quantizes its state
            in blocks (torchao's low-bit AdamWs): use :func:`save`/:func:`load`.
        CheckpointError: Its parameters are not the model's.

    Example:
        >>> # import torch.distributed.checkpoint as dcp
        >>> # dcp.save({"app": stateful(ddp, zero)}, checkpoint_id="ckpt/step-100")
        >>> # dcp.load({"app": stateful(ddp, zero)}, checkpoint_id="ckpt/step-100")
    """
    return ZeroStateful(model, optimizer, ema)
