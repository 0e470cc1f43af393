"""Sharded checkpoints: each rank writes what it owns, any world size reads what it will own.

:func:`save` and :func:`load` are collective. A checkpoint is a directory in
``torch.distributed.checkpoint``'s format (written through :mod:`zero_functional.storage`:
checksummed, atomic), in *model space*, so it depends on neither the world size nor the
partition:

* ``model.<name>``: the model's ``state_dict()`` entries. Each rank writes the pieces of the
  parameters its optimizer owns (the writing is spread like the state); rank 0 writes the rest
  (buffers, parameters outside the optimizer). Every rank reads all of it (every rank needs
  the whole model).
* ``state.<parameter name>.<key>``: the optimizer state, in each parameter's own shape. A rank
  writes the boxes its pieces cover (never padding) and reads only the boxes its pieces under
  the new ownership need; a per-parameter scalar (Adam's ``step``) is written once.
* ``param_groups``: the groups' hyperparameters, each with the names of its parameters;
  ``extra``: whatever the caller passed (an epoch, a data-loader position); ``format``.

No byte of optimizer state goes through the process group. A checkpoint that does not fit
(another model, a missing key, another shape) or whose bytes are not what was written (a
checksum per item) is a :class:`~zero_functional.storage.CheckpointError` on every rank, with
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
from collections.abc import Mapping, Sequence
from typing import Any

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
from zero_functional.main_params import MAIN_KEY, main_dtype_for
from zero_functional.optimizer import ZeroRedundancyOptimizer
from zero_functional.ownership import flat_range_boxes
from zero_functional.partition import Piece
from zero_functional.state_dict import is_elementwise
from zero_functional.steppers import hyperparameters, probe_state
from zero_functional.storage import (
    DEFAULT_MAX_BOX_NUMEL,
    CheckpointError,
    load_pieces,
    read_keys,
    save_pieces,
)

__all__ = [
    "FORMAT",
    "CheckpointError",
    "ZeroStateful",
    "load",
    "model_state_dict",
    "optimizer_state_dict",
    "save",
    "stateful",
]

FORMAT = "zero_functional.checkpoint/1"
"""The ``format`` object of the checkpoints :func:`save` writes."""


def _module(model: nn.Module) -> nn.Module:
    """The wrapped module of a ``DistributedDataParallel``, else the model itself."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def _names(model: nn.Module | None, optimizer: Optimizer) -> list[str]:
    """Each of the optimizer's parameters' name in the model (its index without a model)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if model is None:
        return [str(i) for i in range(len(params))]
    name_of: dict[Tensor, str] = {}
    for name, p in _module(model).named_parameters():
        name_of.setdefault(p, name)
    missing = [i for i, p in enumerate(params) if p not in name_of]
    if missing:
        raise CheckpointError(
            f"the optimizer's parameters {missing} are not parameters of the model: pass the "
            "model the optimizer was built from"
        )
    return [name_of[p] for p in params]


def _group(
    optimizer: Optimizer | None, process_group: dist.ProcessGroup | None
) -> dist.ProcessGroup | None:
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.process_group
    return process_group


def _shards(optimizer: Optimizer) -> tuple[dict[int, Piece], dict[int, Any]]:
    """The pieces this rank writes and reads, and their state: a ZeroRedundancyOptimizer's own;
    a plain optimizer's (the same on every rank) all whole, written by rank 0, read by all."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        owned = {s.param: s for s in optimizer.ownership.owned(optimizer.rank)}
        return owned, {k: state for k, (_, state) in optimizer.shard_state().items()}
    whole = {k: Piece(k, 0, p.numel()) for k, p in enumerate(params)}
    state = {k: optimizer.state[p] for k, p in enumerate(params) if optimizer.state.get(p)}
    return whole, state


def save(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | None = None,
    optimizer: Optimizer | None = None,
    extra: Any = None,
    process_group: dist.ProcessGroup | None = None,
    max_chunk_numel: int = DEFAULT_MAX_BOX_NUMEL,
) -> None:
    """Write a sharded checkpoint of ``model`` and ``optimizer`` to the directory ``path``.

    Collective: call it on every rank. Atomic: the directory is replaced only once every rank
    has written, so a crash mid-save leaves the previous checkpoint readable.

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

    Raises:
        CheckpointError: On every rank, naming each rank's cause; ``path`` is untouched.

    Example:
        >>> # zero_functional.checkpoint.save("ckpt", model=ddp, optimizer=zero, extra={"epoch": 3})
    """
    if model is None and optimizer is None:
        raise ValueError("save needs a model, an optimizer or both")
    group = _group(optimizer, process_group)
    rank = comm.rank_or_zero(group)
    pieces: dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[int, int, Tensor]]]] = {}
    objects: dict[str, Any] = {"format": FORMAT, "extra": extra}
    in_optimizer: set[Tensor] = set()
    if optimizer is not None:
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer.finish_param_sync()
        sharded = isinstance(optimizer, ZeroRedundancyOptimizer)
        names = _names(model, optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        owned, states = _shards(optimizer)
        for k, state in states.items():
            if not sharded and rank != 0:
                break
            piece, p = owned[k], params[k]
            for key, value in state.items():
                name = f"state.{names[k]}.{key}"
                if is_elementwise(value, piece.stop - piece.start):
                    flat = value.detach().reshape(-1)
                    pieces[name] = (tuple(p.shape), flat.dtype, [(piece.start, piece.stop, flat)])
                elif isinstance(value, Tensor) and value.dim() == 0:
                    pieces[name] = ((), value.dtype, [(0, 1, value.detach().reshape(1))])
                else:  # a whole parameter's other values (a per-tensor optimizer's lists, ...)
                    objects[name] = value
        if model is not None:
            for k, p in enumerate(params):
                in_optimizer.add(p)
                mine = owned.get(k)
                if mine is not None and (sharded or rank == 0):
                    flat = p.detach().reshape(-1)[mine.start : mine.stop]
                    pieces[f"model.{names[k]}"] = (
                        tuple(p.shape),
                        p.dtype,
                        [(mine.start, mine.stop, flat)],
                    )
        objects["param_groups"] = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": names[a : a + n]}
            for g, (a, n) in zip(optimizer.param_groups, _spans(optimizer))
        ]
    if model is not None and rank == 0:  # replicated on every rank: one writer
        for name, t in _module(model).state_dict(keep_vars=True).items():
            if isinstance(t, Tensor) and t not in in_optimizer:
                flat = t.detach().reshape(-1)
                pieces[f"model.{name}"] = (tuple(t.shape), t.dtype, [(0, t.numel(), flat)])
    replicate = (
        optimizer.replicate_group if isinstance(optimizer, ZeroRedundancyOptimizer) else None
    )
    if replicate is None:
        save_pieces(path, pieces, objects, group, max_box_numel=max_chunk_numel)
        return
    # hybrid sharding: the first replica writes each element once; the others wait for its
    # verdict, so that every rank returns (or raises) when the checkpoint is committed
    failure: CheckpointError | None = None
    if comm.group_rank(replicate) == 0:
        try:
            save_pieces(path, pieces, objects, group, max_box_numel=max_chunk_numel)
        except CheckpointError as e:
            failure = e
    with comm.call("checkpoint.save()", replicate):
        verdict = comm.broadcast_object(None if failure is None else str(failure), replicate)
    if failure is not None:
        raise failure
    if verdict is not None:
        raise CheckpointError(str(verdict))


def _spans(optimizer: Optimizer) -> list[tuple[int, int]]:
    """Each group's first global index and length."""
    out, start = [], 0
    for g in optimizer.param_groups:
        out.append((start, len(g["params"])))
        start += len(g["params"])
    return out


def load(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | None = None,
    optimizer: Optimizer | None = None,
    process_group: dist.ProcessGroup | None = None,
    strict: bool = True,
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

    Returns:
        The ``extra`` given to :func:`save`.

    Raises:
        CheckpointError: On every rank, naming the cause; model and optimizer unchanged.

    Example:
        >>> # extra = zero_functional.checkpoint.load("ckpt", model=ddp, optimizer=zero)
    """
    group = _group(optimizer, process_group)
    saved = read_keys(path)
    if "format" not in saved or saved["format"] is not None:
        raise CheckpointError(f"{os.fspath(path)} is not a checkpoint written by {__name__}.save")
    wanted: dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[int, int]]]] = {}
    objects = ["format", "extra"]
    module_state: dict[str, Tensor] = {}
    if model is not None:
        module_state = {
            k: v
            for k, v in _module(model).state_dict(keep_vars=True).items()
            if isinstance(v, Tensor)
        }
        names_saved = {k[len("model.") :] for k in saved if k.startswith("model.")}
        missing = sorted(set(module_state) - names_saved)
        unexpected = sorted(names_saved - set(module_state))
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"the checkpoint does not fit the model: it lacks {missing} and has {unexpected} "
                "in excess (pass strict=False to load the tensors both have)"
            )
        for name, t in module_state.items():
            if name in names_saved:
                source = _model_source(saved, name, t.dtype)
                meta = saved[source]
                assert meta is not None
                wanted[source] = (tuple(t.shape), meta[1], [(0, t.numel())])
    pieces_of: dict[int, dict[str, tuple[str, bool]]] = {}
    owned: dict[int, Piece] = {}
    if optimizer is not None:
        names = _names(model, optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        owned, _ = _shards(optimizer)
        objects.append("param_groups")
        main_dtype = (
            optimizer.main_params_dtype if isinstance(optimizer, ZeroRedundancyOptimizer) else None
        )
        for k, piece in owned.items():
            prefix = f"state.{names[k]}."
            keeps_main = main_dtype_for(params[k].dtype, main_dtype) is not None
            for key, meta in saved.items():
                if not key.startswith(prefix) or "." in key[len(prefix) :]:
                    continue
                if key[len(prefix) :] == MAIN_KEY and not keeps_main:
                    continue  # a main copy this optimizer does not keep (the model may read it)
                if meta is None:
                    objects.append(key)
                elif meta[0] == ():
                    wanted[key] = ((), meta[1], [(0, 1)])
                else:
                    wanted[key] = (tuple(params[k].shape), meta[1], [(piece.start, piece.stop)])
                pieces_of.setdefault(k, {})[key[len(prefix) :]] = (key, meta is not None)
    tensors, values = load_pieces(path, wanted, objects, group)
    if values["format"] != FORMAT:
        raise CheckpointError(
            f"{os.fspath(path)} has format {values['format']!r}; this version reads {FORMAT!r}"
        )
    if optimizer is not None:
        state: dict[int, dict[str, Any]] = {}
        for k, keys in pieces_of.items():
            p, piece = params[k], owned[k]
            whole = piece.start == 0 and piece.stop == p.numel()
            entry: dict[str, Any] = {}
            for state_key, (key, is_tensor) in keys.items():
                if not is_tensor:
                    entry[state_key] = values[key]
                elif wanted[key][0] == ():
                    entry[state_key] = tensors[key][0].reshape(())
                else:
                    entry[state_key] = tensors[key][0].view(p.shape) if whole else tensors[key][0]
            model_key = f"model.{names[k]}"
            if (
                entry
                and MAIN_KEY not in entry
                and main_dtype_for(p.dtype, main_dtype) is not None
                and model_key in tensors
                and tensors[model_key][0].dtype.itemsize > p.dtype.itemsize
            ):  # saved from a wider model (a plain fp32 run): its values are the main copy
                main = tensors[model_key][0][piece.start : piece.stop]
                entry[MAIN_KEY] = main.view(p.shape) if whole else main
            state[k] = entry
        saved_groups = values["param_groups"]
        expected = [names[a : a + n] for a, n in _spans(optimizer)]
        if (
            not isinstance(saved_groups, list)
            or [g.get("params") for g in saved_groups] != expected
        ):
            raise CheckpointError(
                "the checkpoint's parameter groups list other parameters than the optimizer's: "
                "it belongs to another model (or the groups were built in another order)"
            )
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer.finish_param_sync()
            optimizer.load_shard_state(state, saved_groups, copy=False)  # fresh tensors
        else:
            optimizer.load_state_dict(
                {
                    "state": state,
                    "param_groups": [
                        {**g, "params": list(range(a, a + n))}
                        for g, (a, n) in zip(saved_groups, _spans(optimizer))
                    ],
                }
            )
    if model is not None:
        with torch.no_grad():
            for name, t in module_state.items():
                if name in names_saved:  # in the saved dtype: cast as load_state_dict does
                    t.copy_(tensors[_model_source(saved, name, t.dtype)][0].view(t.shape))
    return values["extra"]


def _model_source(
    saved: Mapping[str, tuple[tuple[int, ...], torch.dtype] | None], name: str, dtype: torch.dtype
) -> str:
    """The key a model tensor ``name`` of ``dtype`` is read from: its ``model.`` entry, or the
    main copy saved with the optimizer state where that holds finer values the tensor can keep
    (a bf16 model trained with ``main_params_dtype`` loading into an fp32 model)."""
    key, main = f"model.{name}", f"state.{name}.{MAIN_KEY}"
    model_meta, main_meta = saved.get(key), saved.get(main)
    if model_meta is None or main_meta is None:
        return key
    narrow = model_meta[1].itemsize
    return main if main_meta[1].itemsize > narrow and dtype.itemsize > narrow else key


def model_state_dict(flat: Mapping[str, Any]) -> dict[str, Tensor]:
    """The model's ``state_dict`` from a ``dcp_to_torch_save`` file of a checkpoint.

    Example:
        >>> model_state_dict({"model.w": 1, "state.w.step": 2, "extra": None})
        {'w': 1}
    """
    return {k[len("model.") :]: v for k, v in flat.items() if k.startswith("model.")}


def optimizer_state_dict(flat: Mapping[str, Any]) -> dict[str, Any]:
    """A plain ``torch.optim`` state dict from a ``dcp_to_torch_save`` file of a checkpoint.

    Parameters are numbered as ``torch.optim`` numbers them: by position in the groups'
    ``params`` lists, concatenated.

    Example:
        >>> flat = {"state.w.step": 3, "param_groups": [{"lr": 0.1, "params": ["w"]}]}
        >>> optimizer_state_dict(flat)
        {'state': {0: {'step': 3}}, 'param_groups': [{'lr': 0.1, 'params': [0]}]}
    """
    groups = flat["param_groups"]
    order = [name for g in groups for name in g["params"]]
    index = {name: i for i, name in enumerate(order)}
    state: dict[int, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith("state."):
            name, state_key = key[len("state.") :].rsplit(".", 1)  # state keys have no dot
            state.setdefault(index[name], {})[state_key] = value
    return {
        "state": state,
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups],
    }


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
    the state one step of its class makes (every parameter that requires grad gets one): a
    checkpoint saved before some parameter had state does not load (DCP names the missing
    key). As DCP does with torch's own state dicts, ``dcp.load`` writes into the model's
    parameters and into the state it was given, then :meth:`load_state_dict` installs the
    optimizer state (checked against the class's own state, collective).
    """

    def __init__(self, model: nn.Module, optimizer: ZeroRedundancyOptimizer) -> None:
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
        self.model = model
        self.optimizer = optimizer
        self._names = _names(model, optimizer)  # checks that the parameters are the model's
        self._flat: dict[tuple[str, str], tuple[ShardedTensor, Tensor]] = {}

    def state_dict(self) -> dict[str, Any]:
        """The model's state and the optimizer's groups and this rank's state; no copies."""
        zero = self.optimizer
        zero.finish_param_sync()  # the model's parameters are read (or written) next
        return {
            "model": _module(self.model).state_dict(),
            "optimizer": {
                "state": self._optimizer_state(),
                "param_groups": [
                    {**hyperparameters(g), "params": self._names[a : a + n]}
                    for g, (a, n) in zip(zero.param_groups, _spans(zero))
                ],
            },
        }

    def _optimizer_state(self) -> dict[str, dict[str, Any]]:
        zero = self.optimizer
        params = [p for g in zero.param_groups for p in g["params"]]
        group_of = [i for i, (_, n) in enumerate(_spans(zero)) for _ in range(n)]
        held = zero.shard_state()
        probes: dict[int, dict[str, Any] | None] = {}
        self._flat = {}
        out: dict[str, dict[str, Any]] = {}
        for piece in zero.ownership.owned(zero.rank):
            k, p = piece.param, params[piece.param]
            numel = piece.stop - piece.start
            if k in held:
                values, fresh = held[k][1], False
            elif p.requires_grad:  # a template: the keys one step of the class makes
                g = group_of[k]
                if g not in probes:
                    probes[g] = probe_state(zero.optimizer_class, zero.param_groups[g], {})
                probe = probes[g]
                if probe is None:
                    continue
                values, fresh = probe, True
            else:
                continue
            entry: dict[str, Any] = {}
            for key, v in values.items():
                if isinstance(v, Tensor) and is_elementwise(v, 2 if fresh else numel):
                    if fresh:
                        dtype = p.dtype if v.is_floating_point() or v.is_complex() else v.dtype
                        flat = torch.empty(numel, dtype=dtype, device=p.device)
                    else:
                        flat = v.detach().reshape(-1)
                    st = _sharded(flat, p.shape, zero.ownership.holders(k), zero)
                    self._flat[(self._names[k], key)] = (st, flat)
                    entry[key] = st
                elif isinstance(v, Tensor):
                    entry[key] = torch.empty_like(v) if fresh else v
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
        groups = saved["param_groups"]
        expected = [self._names[a : a + n] for a, n in _spans(zero)]
        if [g.get("params") for g in groups] != expected:
            raise CheckpointError(
                "the checkpoint's parameter groups list other parameters than the optimizer's: "
                "it belongs to another model (or the groups were built in another order)"
            )
        index = {name: k for k, name in enumerate(self._names)}
        params = [p for g in zero.param_groups for p in g["params"]]
        owned = {s.param: s for s in zero.ownership.owned(zero.rank)}
        state: dict[int, dict[str, Any]] = {}
        for name, entry in saved["state"].items():
            k = index[name]
            piece, p = owned[k], params[k]
            whole = piece.start == 0 and piece.stop == p.numel()
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


def stateful(model: nn.Module, optimizer: ZeroRedundancyOptimizer) -> ZeroStateful:
    """A ``torch.distributed.checkpoint`` ``Stateful`` of ``model`` and its ZeRO ``optimizer``.

    Each rank writes its share of the optimizer state; any world size and either partition
    loads it (see :class:`ZeroStateful`). Call ``dcp.save``/``dcp.load`` on every rank.

    Args:
        model: The model (a ``DistributedDataParallel`` or the module inside it).
        optimizer: The :class:`~zero_functional.optimizer.ZeroRedundancyOptimizer` over its
            parameters.

    Raises:
        TypeError: ``optimizer`` is not a ZeroRedundancyOptimizer.
        ValueError: It is sharded over a ``device_mesh`` (use :func:`save`/:func:`load`).
        CheckpointError: Its parameters are not the model's.

    Example:
        >>> # import torch.distributed.checkpoint as dcp
        >>> # dcp.save({"app": stateful(ddp, zero)}, checkpoint_id="ckpt/step-100")
        >>> # dcp.load({"app": stateful(ddp, zero)}, checkpoint_id="ckpt/step-100")
    """
    return ZeroStateful(model, optimizer)
