"""The checkpoints' on-disk format: the keys, the version constants, the writer and one reader
per format version (:data:`READERS`).

**zero_functional.checkpoint/1** (:data:`FORMAT`): a :mod:`~zero_functional.checkpoint.storage`
directory in *model space* (independent of the world size and the partition), with the keys
``model.<name>`` (the model's ``state_dict()`` tensors), ``state.<parameter name>.<key>`` (the
optimizer state: an elementwise value in its parameter's shape, a 0-d tensor as one, anything
else as an object), ``ema.<parameter name>`` with the object ``ema_n_averaged`` (a
:class:`~zero_functional.ema.ShardedEMA`'s averages), and the objects ``param_groups``
(hyperparameters, parameter names), ``extra`` and ``format``.

**zero_functional.checkpoint/2** (:data:`FORMAT_QUANTIZED`, written when a group's class
quantizes its state in blocks: torchao's low-bit AdamWs): checkpoint/1 plus each block-wise
quantized value as its codes and scales (:mod:`~zero_functional.checkpoint.quantized`).

A new layout is a new version: a new constant, the writer changed, a reader added to
:data:`READERS`; the readers of earlier versions stay.

Example:
    >>> model_key("0.weight"), state_key("0.weight", "exp_avg"), ema_key("0.weight")
    ('model.0.weight', 'state.0.weight.exp_avg', 'ema.0.weight')
    >>> split_state_key("state.0.weight.exp_avg"), split_state_key("model.0.weight")
    (('0.weight', 'exp_avg'), None)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor

from zero_functional.checkpoint import background, quantized, storage
from zero_functional.checkpoint.storage import CheckpointError, Pieces, Saved, Wanted
from zero_functional.comm import ProcessGroup
from zero_functional.core._validate import first_of
from zero_functional.core.blockwise import is_blockwise
from zero_functional.core.main_params import MAIN_KEY
from zero_functional.core.partition import Piece
from zero_functional.core.piece_state import is_elementwise

FORMAT = "zero_functional.checkpoint/1"
"""The ``format`` object of the checkpoints :func:`write` writes without quantized state."""

FORMAT_QUANTIZED = "zero_functional.checkpoint/2"
"""The ``format`` object of those of an optimizer that may keep block-wise quantized state."""

EMA_N_AVERAGED = "ema_n_averaged"
"""The object that holds a saved EMA's number of averaged updates."""

MODEL_PREFIX, STATE_PREFIX, EMA_PREFIX = "model.", "state.", "ema."


def model_key(name: str) -> str:
    """The key of the model tensor ``name`` (see the module's example)."""
    return MODEL_PREFIX + name


def state_key(name: str, key: str) -> str:
    """The key of the optimizer state ``key`` (which has no dot) of the parameter ``name``."""
    return f"{STATE_PREFIX}{name}.{key}"


def ema_key(name: str) -> str:
    """The key of the EMA of the parameter ``name``."""
    return EMA_PREFIX + name


def split_state_key(key: str) -> tuple[str, str] | None:
    """The parameter name and state key of an optimizer state item; ``None`` for another item."""
    if not key.startswith(STATE_PREFIX):
        return None
    name, _, rest = key[len(STATE_PREFIX) :].rpartition(".")
    return (name, rest) if name else None


def model_state_dict(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The model's ``state_dict`` from a ``dcp_to_torch_save`` file of a checkpoint.

    Example:
        >>> model_state_dict({"model.w": 1, "state.w.step": 2, "extra": None})
        {'w': 1}
    """
    return {k[len(MODEL_PREFIX) :]: v for k, v in flat.items() if k.startswith(MODEL_PREFIX)}


def optimizer_state_dict(flat: Mapping[str, Any]) -> dict[str, Any]:
    """A ``torch.optim`` state dict from a ``dcp_to_torch_save`` file, numbered as torch numbers.

    Example:
        >>> optimizer_state_dict({"state.w.step": 3, "param_groups": [{"params": ["w"]}]})
        {'state': {0: {'step': 3}}, 'param_groups': [{'params': [0]}]}
    """
    groups = flat["param_groups"]
    index = {name: i for i, name in enumerate(name for g in groups for name in g["params"])}
    state: dict[int, dict[str, Any]] = {}
    for key, value in flat.items():
        if (split := split_state_key(key)) is not None:
            state.setdefault(index[split[0]], {})[split[1]] = value
    return {
        "state": state,
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups],
    }


def check_groups(saved: object, expected: Sequence[Sequence[str]]) -> list[dict[str, Any]]:
    """The saved ``param_groups``, checked to list the parameters ``expected`` group by group
    (else :class:`CheckpointError`: another model, or another group order).

    Example:
        >>> check_groups([{"lr": 0.1, "params": ["w"]}], [["w"]])
        [{'lr': 0.1, 'params': ['w']}]
    """
    listed = [list(names) for names in expected]
    if not isinstance(saved, list) or [g.get("params") for g in saved] != listed:
        raise CheckpointError(
            "the checkpoint's parameter groups list other parameters than the optimizer's: "
            "it belongs to another model (or the groups were built in another order)"
        )
    return saved


@dataclass(frozen=True)
class Held:
    """One optimizer parameter as a rank writes it: its name (its index without a model), its
    shape, the piece this rank writes, its state over the piece, and the parameter's values and
    its EMA over the piece, flat (``None``: not written)."""

    name: str
    shape: tuple[int, ...]
    piece: Piece
    state: Mapping[str, Any]
    values: Tensor | None
    ema: Tensor | None = None


@dataclass(frozen=True)
class Snapshot:
    """What one rank writes: its :class:`Held` parameters, the model's other tensors (one
    writer), the groups (parameter names; ``None`` without an optimizer), the ``extra``, an
    EMA's count, and whether state may be block-wise quantized (then :data:`FORMAT_QUANTIZED`)."""

    held: Sequence[Held]
    others: Mapping[str, Tensor]
    param_groups: list[dict[str, Any]] | None
    extra: Any
    ema_n_averaged: int | None = None
    quantized: bool = False


def layout(snapshot: Snapshot) -> tuple[Pieces, dict[str, Any]]:
    """The tensor items (:data:`~zero_functional.checkpoint.storage.Pieces`) and objects of a
    snapshot.

    Raises:
        CheckpointError: A quantized value in a snapshot not marked ``quantized``, or one cut
            off its blocks.

    Example:
        >>> held = Held("w", (2,), Piece(0, 0, 2, 2), {"step": torch.tensor(1.0)}, torch.ones(2))
        >>> pieces, objects = layout(Snapshot([held], {"b": torch.zeros(3)}, None, 7))
        >>> sorted(pieces), objects["format"]
        (['model.b', 'model.w', 'state.w.step'], 'zero_functional.checkpoint/1')
    """
    pieces: dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[int, int, Tensor]]]] = {}
    version = FORMAT_QUANTIZED if snapshot.quantized else FORMAT
    objects: dict[str, Any] = {"format": version, "extra": snapshot.extra}
    for held in snapshot.held:
        start, stop = held.piece.start, held.piece.stop
        for key, value in held.state.items():
            item = state_key(held.name, key)
            if is_blockwise(value) and snapshot.quantized:
                more, meta = quantized.items(held.name, held.shape, held.piece, key, value)
                pieces.update(more)
                objects.update(meta)
            elif is_blockwise(value):
                raise CheckpointError(
                    f"the state {item} is block-wise quantized ({type(value).__name__}) but its "
                    "optimizer class has no quantization block: register it with "
                    "zero_functional.register_optimizer(..., block=)"
                )
            elif is_elementwise(value, stop - start):
                flat = value.detach().reshape(-1)
                pieces[item] = (held.shape, flat.dtype, [(start, stop, flat)])
            elif isinstance(value, Tensor) and value.dim() == 0:
                pieces[item] = ((), value.dtype, [(0, 1, value.detach().reshape(1))])
            else:  # a whole parameter's other values (a per-tensor optimizer's lists, ...)
                objects[item] = value
        for key, t in ((ema_key(held.name), held.ema), (model_key(held.name), held.values)):
            if t is not None:
                flat = t.detach().reshape(-1)
                pieces[key] = (held.shape, flat.dtype, [(start, stop, flat)])
    if snapshot.ema_n_averaged is not None:
        objects[EMA_N_AVERAGED] = snapshot.ema_n_averaged
    if snapshot.param_groups is not None:
        objects["param_groups"] = snapshot.param_groups
    for name, t in snapshot.others.items():
        flat = t.detach().reshape(-1)
        pieces[model_key(name)] = (tuple(t.shape), t.dtype, [(0, t.numel(), flat)])
    return pieces, objects


def write(
    path: str | os.PathLike[str],
    snapshot: Snapshot,
    process_group: ProcessGroup | None,
    *,
    max_box_numel: int,
    blocking: bool = True,
    shared: bool = True,
) -> background.SaveHandle | None:
    """Write every rank's snapshot to the directory ``path``, after a save in flight; collective,
    raising as :func:`~zero_functional.checkpoint.storage.save_pieces` does (on every rank).
    ``blocking`` and ``shared`` are :func:`zero_functional.checkpoint.save`'s.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> write(path, Snapshot([], {"b": torch.zeros(3)}, None, 7), group, max_box_numel=1 << 22)
        >>> storage.read_objects(path, ["extra"])
        {'extra': 7}
    """
    pieces, objects = layout(snapshot)
    if not blocking:
        return background.start(path, pieces, objects, process_group, max_box_numel=max_box_numel)
    background.settle(process_group)
    storage.save_pieces(
        path, pieces, objects, process_group, max_box_numel=max_box_numel, shared=shared
    )
    return None


@dataclass(frozen=True)
class Owned:
    """One optimizer parameter as a rank reads it: its name, shape and dtype, the piece it
    reads, and whether its optimizer keeps a main copy of it (in a wider dtype)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    piece: Piece
    keeps_main: bool


@dataclass(frozen=True)
class Request:
    """What a rank reads: the model tensors to fill (name to shape and dtype; ``None``: no
    model), its :class:`Owned` parameters (``None``: no optimizer), the groups' parameter names,
    whether model tensors the checkpoint lacks or has in excess are refused, and whether the
    EMA of the owned pieces is read."""

    model: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None
    owned: Sequence[Owned] | None
    groups: Sequence[Sequence[str]]
    strict: bool = True
    ema: bool = False


@dataclass(frozen=True)
class Contents:
    """What a rank read, in fresh tensors: the model tensors (in the saved dtype), each owned
    parameter's state over its piece (by ``piece.param``), the checked groups (``[]`` without
    an optimizer), the ``extra``; if asked, each owned piece's EMA, flat, and its count."""

    model: dict[str, Tensor]
    state: dict[int, dict[str, Any]]
    param_groups: list[dict[str, Any]]
    extra: Any
    ema: dict[int, Tensor] = field(default_factory=dict)
    ema_n_averaged: int = 0


Read = tuple[Mapping[str, list[Tensor]], Mapping[str, object]]
"""What storage read: per key, its tensors (one per range); per object key, its value."""


class ParamRead(NamedTuple):
    """How one version reads one owned parameter's state: the ranges and objects it needs, and
    its state over the piece from what was read."""

    wanted: Wanted
    objects: list[str]
    state: Callable[[Read], dict[str, Any]]


Reader = Callable[[Saved, Owned, Mapping[str, str]], ParamRead]
"""A format version's reader of one owned parameter's state (``keys``: state key to item key)."""


def read(
    path: str | os.PathLike[str], request: Request, process_group: ProcessGroup | None
) -> Contents:
    """Read what ``request`` needs from the checkpoint at ``path``, each parameter's state by its
    version's reader; collective (the keys and the ``format`` object are read by each rank
    alone first). The model tensors are read whole, the optimizer state over the pieces.

    Raises:
        CheckpointError: Not a checkpoint, a version no reader reads, or one that does not fit.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> write(path, Snapshot([], {}, None, "hi"), group, max_box_numel=1 << 22)
        >>> read(path, Request(model=None, owned=None, groups=[]), group).extra
        'hi'
    """
    saved = storage.read_keys(path)
    if "format" not in saved or saved["format"] is not None:
        raise CheckpointError(
            f"{os.fspath(path)} is not a checkpoint written by zero_functional.checkpoint.save"
        )
    version = storage.read_objects(path, ["format"])["format"]
    reader = READERS.get(version) if isinstance(version, str) else None
    if reader is None:
        raise CheckpointError(
            f"{os.fspath(path)} has format {version!r}; this version reads {sorted(READERS)}"
        )
    sources = _model_sources(saved, request)
    shapes = request.model or {}
    wanted: dict[str, tuple[Sequence[int], torch.dtype, Sequence[tuple[int, int]]]] = {}
    for name, item in sources.items():
        shape, dtype = shapes[name][0], cast(tuple[Any, torch.dtype], saved[item])[1]
        wanted[item] = (shape, dtype, [(0, math.prod(shape))])
    objects = ["extra"] if request.owned is None else ["extra", "param_groups"]
    owned = list(request.owned or ())
    index: dict[str, dict[str, str]] = {}  # per parameter name, its state keys' items
    for item in saved:
        if (split := split_state_key(item)) is not None:
            index.setdefault(split[0], {})[split[1]] = item
    params = {}
    for o in owned:
        keys = {
            k: item for k, item in index.get(o.name, {}).items() if k != MAIN_KEY or o.keeps_main
        }
        params[o.piece.param] = reads = reader(saved, o, keys)
        wanted.update(reads.wanted)
        objects += reads.objects
    if request.ema:
        lacking = [o.name for o in owned if saved.get(ema_key(o.name)) is None]
        if lacking or EMA_N_AVERAGED not in saved:
            raise CheckpointError(
                f"{os.fspath(path)} holds no EMA of {first_of(lacking) or 'any parameter'}: it "
                "was saved without ema=; load it without ema="
            )
        objects.append(EMA_N_AVERAGED)
        for o in owned:
            dtype = cast(tuple[Any, torch.dtype], saved[ema_key(o.name)])[1]
            wanted[ema_key(o.name)] = (o.shape, dtype, [(o.piece.start, o.piece.stop)])
    tensors, values = storage.load_pieces(path, wanted, objects, process_group)
    states = {k: reads.state((tensors, values)) for k, reads in params.items()}
    return Contents(
        model={name: tensors[item][0].view(shapes[name][0]) for name, item in sources.items()},
        state={k: state for k, state in states.items() if state},
        param_groups=(
            [] if request.owned is None else check_groups(values["param_groups"], request.groups)
        ),
        extra=values["extra"],
        ema={o.piece.param: tensors[ema_key(o.name)][0] for o in owned if request.ema},
        ema_n_averaged=int(cast(int, values.get(EMA_N_AVERAGED, 0))),
    )


def read_v1(saved: Saved, owned: Owned, keys: Mapping[str, str]) -> ParamRead:
    """The reader of :data:`FORMAT` (``zero_functional.checkpoint/1``): each value's box over
    the piece (in the parameter's shape if whole), a 0-d value whole, an object as saved."""
    piece = owned.piece
    shape = owned.shape if piece.is_whole else (piece.numel,)
    wanted: dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[int, int]]]] = {}
    objects: list[str] = []
    for item in keys.values():
        if (meta := saved[item]) is None:
            objects.append(item)
        elif meta[0] == ():
            wanted[item] = ((), meta[1], [(0, 1)])
        else:
            wanted[item] = (owned.shape, meta[1], [(piece.start, piece.stop)])

    def state(read: Read) -> dict[str, Any]:
        tensors, values = read
        entry: dict[str, Any] = {}
        for key, item in keys.items():
            if (meta := saved[item]) is None:
                entry[key] = values[item]
            else:
                entry[key] = tensors[item][0].view(() if meta[0] == () else shape)
        model = tensors.get(model_key(owned.name))
        if entry and MAIN_KEY not in entry and owned.keeps_main and model is not None:
            if model[0].dtype.itemsize > owned.dtype.itemsize:  # saved from a wider model (a
                entry[MAIN_KEY] = model[0][piece.start : piece.stop].view(shape)  # fp32 run)
        return entry

    return ParamRead(wanted, objects, state)


def read_v2(saved: Saved, owned: Owned, keys: Mapping[str, str]) -> ParamRead:
    """The reader of :data:`FORMAT_QUANTIZED` (``zero_functional.checkpoint/2``): checkpoint/1
    plus block-wise quantized state, each rank reading the whole blocks around its pieces
    (:func:`~.quantized.reads`, :func:`~.quantized.rebuilt`)."""
    v1 = read_v1(saved, owned, keys)
    plan, more = quantized.reads(saved, owned.name, owned.shape, owned.piece)
    shape = owned.shape if owned.piece.is_whole else (owned.piece.numel,)

    def state(read: Read) -> dict[str, Any]:
        rebuilt = quantized.rebuilt(owned.name, plan, *read, owned.piece, shape)
        return {**v1.state(read), **rebuilt}

    objects = v1.objects + [quantized.quantized_key(owned.name, r.key) for r in plan]
    return ParamRead({**v1.wanted, **more}, objects, state)


READERS: dict[str, Reader] = {FORMAT: read_v1, FORMAT_QUANTIZED: read_v2}
"""The reader of each directory format version."""


def _model_sources(saved: Saved, request: Request) -> dict[str, str]:
    """Per model tensor to fill, the key it is read from (refusing a misfit when strict): its
    ``model.`` item, or the main copy saved with the optimizer state where that holds finer
    values the tensor can keep (a bf16 model trained with ``main_params_dtype`` loading into an
    fp32 model)."""
    if request.model is None:
        return {}
    names_saved = {k[len(MODEL_PREFIX) :] for k in saved if k.startswith(MODEL_PREFIX)}
    missing = sorted(set(request.model) - names_saved)
    unexpected = sorted(names_saved - set(request.model))
    if request.strict and (missing or unexpected):
        raise CheckpointError(
            f"the checkpoint does not fit the model: it lacks [{first_of(missing)}] and has "
            f"[{first_of(unexpected)}] in excess (pass strict=False to load the tensors both have)"
        )
    sources = {name: model_key(name) for name in request.model if name in names_saved}
    for name, key in sources.items():
        main, narrow = state_key(name, MAIN_KEY), saved[key]
        if narrow is not None and (wide := saved.get(main)) is not None:
            itemsize = narrow[1].itemsize
            if wide[1].itemsize > itemsize and request.model[name][1].itemsize > itemsize:
                sources[name] = main
    return sources
