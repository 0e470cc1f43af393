"""The checkpoints' on-disk format: the keys, the version constants, the writers and one reader
per format version.

**zero_functional.checkpoint/1** (:data:`FORMAT`): a directory written through
:mod:`zero_functional.checkpoint.storage` (``torch.distributed.checkpoint``'s format, a checksum per item,
replaced atomically), in *model space*, so that it depends on neither the world size nor the
partition:

* ``model.<name>`` (:func:`model_key`): the model's ``state_dict()`` tensors, in their shapes;
* ``state.<parameter name>.<key>`` (:func:`state_key`): the optimizer state, an elementwise value
  in its parameter's shape, a 0-d tensor (Adam's ``step``) as a 0-d tensor, anything else as an
  object;
* ``ema.<parameter name>`` (:func:`ema_key`): a :class:`~zero_functional.ema.ShardedEMA`'s
  average of the parameter, in its shape, with the object ``ema_n_averaged``, where one was saved;
* the objects ``param_groups`` (each group's hyperparameters and its parameters' names),
  ``extra`` (the caller's) and ``format`` (this version's name).

**zero_functional.checkpoint/2** (:data:`FORMAT_QUANTIZED`, written when a group's class
quantizes its state in blocks: torchao's low-bit AdamWs): checkpoint/1 plus, for each
block-wise quantized state value, its codes and scales as flat items and one object
(:mod:`~zero_functional.checkpoint.quantized`), read by :func:`read_v2`. The item keys are
:mod:`~zero_functional.checkpoint.keys`' (re-exported here).

:func:`layout` says which items a rank's :class:`Snapshot` becomes and :func:`write` writes them;
:func:`read` reads what a rank's :class:`Request` needs with the reader of the version the
checkpoint names (:data:`READERS`: :func:`read_v1`, :func:`read_v2`) and hands back :class:`Contents`.

**zero_functional.app.train/1** (:data:`TRAIN_FORMAT`): the demo train job's, in two layouts, both
read by :func:`read_train`: a checkpoint/1 directory whose ``extra`` is :func:`train_extra`
(:func:`read_train_directory`), or one ``torch.save`` file of ``format``, ``model``,
``optimizer``, ``epoch`` and ``args`` (what ``--impl torch`` writes, and what earlier versions
wrote: :func:`write_train_file`, :func:`read_train_file`).

A new layout is a new version: a new constant, the writer changed, a reader added to
:data:`READERS`; the readers of earlier versions stay.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from zero_functional.checkpoint import background, quantized, storage
from zero_functional.checkpoint.keys import (
    MODEL_PREFIX,
    STATE_PREFIX,
    check_groups,
    ema_key,
    model_key,
    model_state_dict,
    optimizer_state_dict,
    split_state_key,
    state_key,
)
from zero_functional.checkpoint.storage import CheckpointError, Pieces
from zero_functional.comm import ProcessGroup
from zero_functional.core._validate import first_of
from zero_functional.core.blockwise import is_blockwise
from zero_functional.core.main_params import MAIN_KEY
from zero_functional.core.partition import Piece
from zero_functional.core.piece_state import is_elementwise

__all__ = [
    "FORMAT",
    "FORMAT_QUANTIZED",
    "READERS",
    "TRAIN_FORMAT",
    "Contents",
    "Held",
    "Owned",
    "Request",
    "Snapshot",
    "EMA_N_AVERAGED",
    "check_groups",
    "ema_key",
    "layout",
    "model_key",
    "model_state_dict",
    "optimizer_state_dict",
    "read",
    "read_train",
    "read_train_directory",
    "read_train_file",
    "read_v1",
    "read_v2",
    "split_state_key",
    "state_key",
    "train_extra",
    "write",
    "write_train_file",
]

FORMAT = "zero_functional.checkpoint/1"
"""The ``format`` object of the checkpoints :func:`write` writes without quantized state."""

FORMAT_QUANTIZED = "zero_functional.checkpoint/2"
"""The ``format`` object of those of an optimizer that may keep block-wise quantized state."""

TRAIN_FORMAT = "zero_functional.app.train/1"
"""The ``format`` key of the train job's checkpoints; others are refused on resume."""

EMA_N_AVERAGED = "ema_n_averaged"
"""The object that holds a saved EMA's number of averaged updates."""


# ------------------------------------------------------------------------------ writing


@dataclass(frozen=True)
class Held:
    """One optimizer parameter as a rank writes it.

    Attributes:
        name: Its name in the model (or its index, without a model).
        shape: Its shape.
        piece: The elements this rank writes.
        state: Its optimizer state over ``piece`` (elementwise values flat or in shape).
        values: The parameter's own values over ``piece``, flat; ``None`` to write no model.
        ema: Its EMA over ``piece``, flat; ``None`` to write none.
    """

    name: str
    shape: tuple[int, ...]
    piece: Piece
    state: Mapping[str, Any]
    values: Tensor | None
    ema: Tensor | None = None


@dataclass(frozen=True)
class Snapshot:
    """What one rank writes: its :class:`Held` parameters, the model's other tensors (whole,
    one writer), the optimizer's groups (names for parameters; ``None`` without an optimizer)
    and the caller's ``extra``; with an EMA, its number of averaged updates; whether the
    optimizer's class may keep block-wise quantized state (the same on every rank: the
    checkpoint is then :data:`FORMAT_QUANTIZED`)."""

    held: Sequence[Held]
    others: Mapping[str, Tensor]
    param_groups: list[dict[str, Any]] | None
    extra: Any
    ema_n_averaged: int | None = None
    quantized: bool = False


def layout(snapshot: Snapshot) -> tuple[Pieces, dict[str, Any]]:
    """The tensor items (:data:`~zero_functional.checkpoint.storage.Pieces`) and objects of a snapshot;
    a quantized state value as its codes and scales (:func:`~.quantized.items`).

    Raises:
        CheckpointError: A quantized value in a snapshot not marked ``quantized``, or one cut
            off its blocks.

    Example:
        >>> held = Held("w", (2,), Piece(0, 0, 2, 2), {"step": torch.tensor(1.0)}, torch.ones(2))
        >>> pieces, objects = layout(Snapshot([held], {"b": torch.zeros(3)}, None, 7))
        >>> sorted(pieces), objects
        (['model.b', 'model.w', 'state.w.step'], {'format': 'zero_functional.checkpoint/1', 'extra': 7})
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
    for held in snapshot.held:
        if held.ema is not None:
            flat, piece = held.ema.detach().reshape(-1), held.piece
            pieces[ema_key(held.name)] = (held.shape, flat.dtype, [(piece.start, piece.stop, flat)])
        if held.values is not None:
            values, piece = held.values.detach(), held.piece
            pieces[model_key(held.name)] = (
                held.shape,
                values.dtype,
                [(piece.start, piece.stop, values)],
            )
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
) -> background.SaveHandle | None:
    """Write every rank's snapshot to the directory ``path`` in :data:`FORMAT`; collective.
    A save in flight is waited for first (:func:`~zero_functional.checkpoint.background.settle`).

    Args:
        path, snapshot, process_group, max_box_numel: Where, what, who, the largest chunk.
        blocking: Return once committed (``None``); else once the state is copied, with the
            handle of the write (:func:`~zero_functional.checkpoint.background.start`).

    Raises:
        CheckpointError: On every rank (see :func:`~zero_functional.checkpoint.storage.save_pieces`).

    Example:
        >>> # write("ckpt", snapshot, None, max_box_numel=1 << 22)
    """
    pieces, objects = layout(snapshot)
    if not blocking:
        return background.start(path, pieces, objects, process_group, max_box_numel=max_box_numel)
    background.settle(process_group)
    storage.save_pieces(path, pieces, objects, process_group, max_box_numel=max_box_numel)
    return None


# ------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class Owned:
    """One optimizer parameter as a rank reads it: its name, shape and dtype, the elements it
    reads, and whether its optimizer keeps a main copy of it (in a wider dtype)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    piece: Piece
    keeps_main: bool


@dataclass(frozen=True)
class Request:
    """What a rank reads: the model tensors to fill (name to shape and dtype; ``None`` for no
    model), its :class:`Owned` parameters (``None`` for no optimizer), the optimizer's groups'
    parameter names, whether model tensors the checkpoint lacks or has in excess are
    refused, and whether the EMA of the owned pieces is read."""

    model: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None
    owned: Sequence[Owned] | None
    groups: Sequence[Sequence[str]]
    strict: bool = True
    ema: bool = False


@dataclass(frozen=True)
class Contents:
    """What a rank read, in fresh tensors: the model tensors in their shapes (in the saved
    dtype), each :class:`Owned` parameter's state over its piece (by ``piece.param``), the
    checked groups (``[]`` without an optimizer) and the ``extra``; where the request asked
    for it, the EMA of each owned piece, flat (by ``piece.param``), and its count."""

    model: dict[str, Tensor]
    state: dict[int, dict[str, Any]]
    param_groups: list[dict[str, Any]]
    extra: Any
    ema: dict[int, Tensor] = field(default_factory=dict)
    ema_n_averaged: int = 0


Saved = Mapping[str, tuple[tuple[int, ...], torch.dtype] | None]
"""A checkpoint's keys: ``(shape, dtype)`` for a tensor, ``None`` for an object."""
Reader = Callable[[str | os.PathLike[str], Saved, Request, ProcessGroup | None], Contents]
"""A format version's reader: the path, its keys, what to read, the ranks that read."""


def read(
    path: str | os.PathLike[str], request: Request, process_group: ProcessGroup | None
) -> Contents:
    """Read what ``request`` needs from the checkpoint at ``path``, by its version's reader.

    Collective. The keys and the ``format`` object are read by each rank alone first.

    Raises:
        CheckpointError: Not a checkpoint, a version no reader reads, or one that does not fit.

    Example:
        >>> # read("ckpt", Request(model=None, owned=[], groups=[[]]), None).extra
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
    return reader(path, saved, request, process_group)


def _model_sources(saved: Saved, request: Request) -> dict[str, str]:
    """Per model tensor to fill, the key it is read from; refuses a misfit when strict."""
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
    return {
        name: _model_source(saved, name, dtype)
        for name, (_, dtype) in request.model.items()
        if name in names_saved
    }


def _model_source(saved: Saved, name: str, dtype: torch.dtype) -> str:
    """The key a model tensor ``name`` of ``dtype`` is read from: its ``model.`` entry, or the
    main copy saved with the optimizer state where that holds finer values the tensor can keep
    (a bf16 model trained with ``main_params_dtype`` loading into an fp32 model)."""
    key, main = model_key(name), state_key(name, MAIN_KEY)
    model_meta, main_meta = saved.get(key), saved.get(main)
    if model_meta is None or main_meta is None:
        return key
    narrow = model_meta[1].itemsize
    return main if main_meta[1].itemsize > narrow and dtype.itemsize > narrow else key


def _state_keys(saved: Saved, owned: Owned) -> dict[str, str]:
    """The saved state of one parameter: its state key to its item's key."""
    out: dict[str, str] = {}
    for key in saved:
        split = split_state_key(key)
        if split is None or split[0] != owned.name:
            continue
        if split[1] == MAIN_KEY and not owned.keeps_main:
            continue  # a main copy this optimizer does not keep (the model may read it)
        out[split[1]] = key
    return out


def _shape(owned: Owned) -> tuple[int, ...]:
    """The shape of an owned piece's state: the parameter's when whole, else flat."""
    whole = owned.piece.is_whole
    return owned.shape if whole else (owned.piece.stop - owned.piece.start,)


def _entry(
    owned: Owned,
    keys: Mapping[str, str],
    saved: Saved,
    read: tuple[Mapping[str, list[Tensor]], Mapping[str, object]],
) -> dict[str, Any]:
    """One parameter's state over its piece, from what was read (in its shape if whole)."""
    tensors, values = read
    piece = owned.piece
    whole = piece.is_whole
    entry: dict[str, Any] = {}
    for name, key in keys.items():
        meta = saved[key]
        if meta is None:
            entry[name] = values[key]
        elif meta[0] == ():
            entry[name] = tensors[key][0].reshape(())
        else:
            entry[name] = tensors[key][0].view(owned.shape) if whole else tensors[key][0]
    model = tensors.get(model_key(owned.name))
    if (
        entry
        and MAIN_KEY not in entry
        and owned.keeps_main
        and model is not None
        and model[0].dtype.itemsize > owned.dtype.itemsize
    ):  # saved from a wider model (a plain fp32 run): its values are the main copy
        main = model[0][piece.start : piece.stop]
        entry[MAIN_KEY] = main.view(owned.shape) if whole else main
    return entry


def read_v1(
    path: str | os.PathLike[str],
    saved: Saved,
    request: Request,
    process_group: ProcessGroup | None,
) -> Contents:
    """The reader of :data:`FORMAT` (``zero_functional.checkpoint/1``); collective.

    Each rank reads the whole model tensors it fills and only the boxes of optimizer state its
    pieces cover. Everything is checked (keys, shapes, dtypes, checksums, groups) before a
    value is handed back.

    Example:
        >>> # read_v1("ckpt", storage.read_keys("ckpt"), request, None)
    """
    return _read(path, saved, request, process_group, with_quantized=False)


def read_v2(
    path: str | os.PathLike[str],
    saved: Saved,
    request: Request,
    process_group: ProcessGroup | None,
) -> Contents:
    """The reader of :data:`FORMAT_QUANTIZED` (``zero_functional.checkpoint/2``): format 1 plus
    block-wise quantized state, each rank reading the whole blocks around its pieces
    (:func:`~.quantized.reads`, :func:`~.quantized.rebuilt`); collective.

    Example:
        >>> # read_v2("ckpt", storage.read_keys("ckpt"), request, None)
    """
    return _read(path, saved, request, process_group, with_quantized=True)


def _read(
    path: str | os.PathLike[str],
    saved: Saved,
    request: Request,
    process_group: ProcessGroup | None,
    *,
    with_quantized: bool,
) -> Contents:
    sources = _model_sources(saved, request)
    shapes = request.model or {}
    wanted: dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[int, int]]]] = {}
    for name, source in sources.items():
        meta, shape = saved[source], shapes[name][0]
        assert meta is not None  # a tensor: _model_sources picks tensor keys
        wanted[source] = (shape, meta[1], [(0, torch.Size(shape).numel())])
    objects = ["extra"] if request.owned is None else ["extra", "param_groups"]
    keys = {o.piece.param: _state_keys(saved, o) for o in request.owned or ()}
    for owned in request.owned or ():
        for key in keys[owned.piece.param].values():
            meta = saved[key]
            if meta is None:
                objects.append(key)
            elif meta[0] == ():
                wanted[key] = ((), meta[1], [(0, 1)])
            else:
                wanted[key] = (owned.shape, meta[1], [(owned.piece.start, owned.piece.stop)])
    plans = {
        o.piece.param: (
            quantized.reads(saved, o.name, o.shape, o.piece) if with_quantized else ([], {})
        )
        for o in request.owned or ()
    }
    for owned in request.owned or ():
        plan, more = plans[owned.piece.param]
        wanted.update(more)
        objects.extend(quantized.quantized_key(owned.name, r.key) for r in plan)
    if request.ema:
        lacking = [o.name for o in request.owned or () if saved.get(ema_key(o.name)) is None]
        if lacking or EMA_N_AVERAGED not in saved:
            raise CheckpointError(
                f"{os.fspath(path)} holds no EMA of {first_of(lacking) or 'any parameter'}: it was "
                "saved "
                "without ema=; load it without ema="
            )
        objects.append(EMA_N_AVERAGED)
        for owned in request.owned or ():
            meta = saved[ema_key(owned.name)]
            assert meta is not None
            wanted[ema_key(owned.name)] = (
                owned.shape,
                meta[1],
                [(owned.piece.start, owned.piece.stop)],
            )
    read = storage.load_pieces(path, wanted, objects, process_group)
    tensors, values = read
    return Contents(
        model={name: tensors[key][0].view(shapes[name][0]) for name, key in sources.items()},
        state={
            o.piece.param: {
                **_entry(o, keys[o.piece.param], saved, read),
                **quantized.rebuilt(
                    o.name, plans[o.piece.param][0], tensors, values, o.piece, _shape(o)
                ),
            }
            for o in request.owned or ()
            if keys[o.piece.param] or plans[o.piece.param][0]
        },
        param_groups=(
            [] if request.owned is None else check_groups(values["param_groups"], request.groups)
        ),
        extra=values["extra"],
        ema={
            o.piece.param: tensors[ema_key(o.name)][0] for o in request.owned or () if request.ema
        },
        ema_n_averaged=int(cast(int, values.get(EMA_N_AVERAGED, 0))),
    )


READERS: dict[str, Reader] = {FORMAT: read_v1, FORMAT_QUANTIZED: read_v2}
"""The reader of each directory format version."""


# ------------------------------------------------------------------------------ the train job's


def train_extra(epoch: int, args: Mapping[str, Any]) -> dict[str, Any]:
    """The ``extra`` of a train job's checkpoint directory (and the head of its single file).

    Example:
        >>> train_extra(2, {"hidden": 8})
        {'format': 'zero_functional.app.train/1', 'epoch': 2, 'args': {'hidden': 8}}
    """
    return {"format": TRAIN_FORMAT, "epoch": epoch, "args": dict(args)}


def write_train_file(path: str | os.PathLike[str], payload: Mapping[str, object]) -> None:
    """Write ``payload`` with ``torch.save`` atomically: a crash mid-write keeps the old file.

    The bytes go to a temporary file in the same directory, are flushed to disk, and then
    ``os.replace`` renames it over ``path`` (atomic on POSIX and Windows).

    Example:
        >>> # write_train_file("ckpt.pt", {**train_extra(1, args), "model": ..., "optimizer": ...})
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(dict(payload), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _first_line(e: BaseException) -> str:
    """The informative line of an exception (torch's load_state_dict puts it second)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Error(s) in loading"):
        lines = lines[1:]
    return (lines or [type(e).__name__])[0][:300]


def read_train(
    path: str | os.PathLike[str], build_model: Callable[[int], nn.Module]
) -> dict[str, Any]:
    """Read and check a train job's checkpoint: a directory, or a single (older) file.

    Args:
        path: The checkpoint.
        build_model: The job's model for a ``hidden`` width (checked against the checkpoint).

    Raises:
        CheckpointError: Missing, corrupt, not the job's format, or not the job's model.

    Example:
        >>> # read_train("ckpt", zero_functional.app.train.build_model)["epoch"]
    """
    p = Path(path)
    if p.is_dir():
        return read_train_directory(p, build_model)
    return read_train_file(p, build_model)


def read_train_file(
    path: str | os.PathLike[str], build_model: Callable[[int], nn.Module]
) -> dict[str, Any]:
    """The reader of a train job's single ``torch.save`` file (``zero_functional.app.train/1``).

    The zip archive's CRCs are verified, then the model and Adam state are loaded into the
    model its own ``args`` describe. The result holds ``model``, ``optimizer``, ``epoch`` and
    ``args``.

    Raises:
        CheckpointError: Missing, corrupt, not the job's format, or not the job's model.

    Example:
        >>> # read_train_file("ckpt.pt", zero_functional.app.train.build_model)["model"]
    """
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"checkpoint {p} does not exist")
    if not zipfile.is_zipfile(p):
        raise CheckpointError(f"checkpoint {p} is corrupt or truncated: not a torch.save archive")
    try:
        with zipfile.ZipFile(p) as archive:
            bad = archive.testzip()  # every member's CRC32: a flipped byte is caught here
    except (zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f"checkpoint {p} is corrupt: {e}") from e
    if bad is not None:
        raise CheckpointError(f"checkpoint {p} is corrupt: {bad} fails its CRC32 check")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {p} is corrupt: {_first_line(e)}") from e
    ckpt = _train_dict(p, ckpt)
    missing = {"model", "optimizer", "epoch", "args"} - ckpt.keys()
    if missing:
        raise CheckpointError(f"checkpoint {p} lacks {sorted(missing)}; it is truncated or edited")
    try:
        model = build_model(int(ckpt["args"]["hidden"]))
        model.load_state_dict(ckpt["model"])
        torch.optim.Adam(model.parameters()).load_state_dict(ckpt["optimizer"])
        _check_optimizer_shapes(model, ckpt["optimizer"])
    except Exception as e:
        raise CheckpointError(f"checkpoint {p} does not fit the demo MLP: {_first_line(e)}") from e
    return dict(ckpt)


def _train_dict(path: str | os.PathLike[str], saved: object) -> dict[str, Any]:
    """``saved`` if it is a dict of :data:`TRAIN_FORMAT`; else what the train job did not write
    is refused."""
    if not isinstance(saved, dict) or saved.get("format") != TRAIN_FORMAT:
        raise CheckpointError(
            f"checkpoint {path} was not written by `zero-functional train --checkpoint` "
            f"(no format {TRAIN_FORMAT!r})"
        )
    return saved


def _check_optimizer_shapes(model: nn.Module, state_dict: Mapping[str, Any]) -> None:
    params = list(model.parameters())
    for index, state in state_dict["state"].items():
        for key, value in state.items():
            if isinstance(value, Tensor) and value.dim() and value.shape != params[index].shape:
                raise ValueError(
                    f"the optimizer state {key!r} of parameter {index} has shape "
                    f"{tuple(value.shape)}, the parameter {tuple(params[index].shape)}"
                )


def read_train_directory(
    path: str | os.PathLike[str], build_model: Callable[[int], nn.Module]
) -> dict[str, Any]:
    """The reader of a train job's checkpoint directory (:data:`FORMAT` with a train ``extra``).

    Every stored item's checksum is verified, in this process alone, and the model and
    optimizer items are checked against the model its own ``args`` describe. The result is
    the ``extra`` (``format``, ``epoch``, ``args``) and ``sharded``, the path.

    Raises:
        CheckpointError: Corrupt, not the job's format, or not the job's model.

    Example:
        >>> # read_train_directory("ckpt", zero_functional.app.train.build_model)["sharded"]
    """
    try:
        storage.verify(path)
        extra = storage.read_objects(path, ["extra"])["extra"]
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {path}: {_first_line(e)}") from e
    extra = _train_dict(path, extra)
    model = build_model(int(extra["args"]["hidden"]))
    keys = storage.read_keys(path)
    names = [name for name, _ in model.named_parameters()]
    for name, p in model.named_parameters():
        for key, meta in keys.items():
            split = split_state_key(key)
            if key == model_key(name) or (split is not None and split[0] == name):
                if meta is not None and meta[0] not in ((), tuple(p.shape)):
                    raise CheckpointError(
                        f"checkpoint {path} does not fit the demo MLP: {key} has shape "
                        f"{meta[0]}, the model's {name} {tuple(p.shape)}"
                    )
    unknown = sorted(
        k
        for k in keys
        if k.startswith(STATE_PREFIX) and (split_state_key(k) or ("", ""))[0] not in names
    )
    if unknown or any(model_key(n) not in keys for n in names):
        raise CheckpointError(
            f"checkpoint {path} does not fit the demo MLP (hidden {extra['args']['hidden']}): "
            f"{unknown[:3] or 'model tensors are missing'}"
        )
    return {**extra, "sharded": str(path)}
