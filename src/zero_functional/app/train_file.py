"""The demo train job's checkpoint files (format ``zero_functional.app.train/1``): a
:mod:`zero_functional.checkpoint` directory whose ``extra`` is :func:`train_extra`, or one
``torch.save`` file (``--impl torch``'s, and earlier versions'). Read before any rank starts:
checksums, the format, and shapes against the model the checkpoint's own ``args`` describe.

Example:
    >>> train_extra(2, {"hidden": 8})
    {'format': 'zero_functional.app.train/1', 'epoch': 2, 'args': {'hidden': 8}}
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from zero_functional import checkpoint
from zero_functional.app.train_options import NODE_LOCAL, OURS, TrainConfig
from zero_functional.checkpoint import storage
from zero_functional.checkpoint.format import MODEL_PREFIX, STATE_PREFIX, model_key, split_state_key
from zero_functional.checkpoint.storage import CheckpointError

TRAIN_FORMAT = "zero_functional.app.train/1"  # the ``format`` key; others are refused


def train_extra(epoch: int, args: Mapping[str, Any]) -> dict[str, Any]:
    """The ``extra`` of a train job's checkpoint directory (and the head of its single file)."""
    return {"format": TRAIN_FORMAT, "epoch": epoch, "args": dict(args)}


def write(
    cfg: TrainConfig, rank: int, model: nn.Module, opt: Optimizer, at: tuple[int, int], hidden: int
) -> None:
    """Save the job on every rank after ``at`` (epochs done, steps done in the next epoch; a
    resume starts there): ours, each rank's share of a directory; torch's class, the state
    consolidated on rank 0, which writes one file."""
    assert cfg.checkpoint is not None
    args = {k: v for k, v in asdict(cfg).items() if k not in NODE_LOCAL}
    extra = {**train_extra(at[0], {**args, "hidden": hidden}), "step": at[1]}
    if cfg.impl == OURS:
        checkpoint.save(cfg.checkpoint, model=model, optimizer=opt, extra=extra)
        return
    opt.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
    if rank == 0:
        payload = {**extra, "model": model.state_dict(), "optimizer": opt.state_dict()}
        write_train_file(cfg.checkpoint, payload)


def read_position(path: str | os.PathLike[str]) -> tuple[int, int]:
    """Where the train job's checkpoint directory at ``path`` stands (epochs done, steps into
    the next), from its ``extra`` alone: no state is read.

    Example:
        >>> read_position("no-such-checkpoint")
        Traceback (most recent call last):
        ...
        zero_functional.checkpoint.storage.CheckpointError: ...no-such-checkpoint...
    """
    extra = _train_dict(path, storage.read_objects(path, ["extra"])["extra"])
    return int(extra["epoch"]), int(extra.get("step", 0))


def write_train_file(path: str | os.PathLike[str], payload: Mapping[str, object]) -> None:
    """Write ``payload`` with ``torch.save`` atomically: a crash mid-write keeps the old file
    (a temporary file in the same directory, flushed, then renamed over ``path``).

    Example:
        >>> import tempfile
        >>> target = Path(tempfile.mkdtemp()) / "ck.pt"
        >>> write_train_file(target, train_extra(1, {"hidden": 8}))
        >>> torch.load(target)["epoch"]
        1
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
    """Read and check a train job's checkpoint, a directory or a single (older) file, against
    ``build_model(hidden)``; a :class:`CheckpointError` says what is wrong.

    Example:
        >>> read_train("no-such-checkpoint", nn.Linear)
        Traceback (most recent call last):
        ...
        zero_functional.checkpoint.storage.CheckpointError: checkpoint no-such-checkpoint does not exist
    """
    return (read_train_directory if Path(path).is_dir() else read_train_file)(path, build_model)


def read_train_file(
    path: str | os.PathLike[str], build_model: Callable[[int], nn.Module]
) -> dict[str, Any]:
    """The reader of a single ``torch.save`` file: the zip archive's CRCs, then the model and
    Adam state loaded into the model its ``args`` describe. Returns ``model``, ``optimizer``,
    ``epoch`` and ``args``."""
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
    if missing := {"model", "optimizer", "epoch", "args"} - ckpt.keys():
        raise CheckpointError(f"checkpoint {p} lacks {sorted(missing)}; it is truncated or edited")
    try:
        model = build_model(int(ckpt["args"]["hidden"]))
        model.load_state_dict(ckpt["model"])
        torch.optim.Adam(model.parameters()).load_state_dict(ckpt["optimizer"])
        params = list(model.parameters())
        for index, state in ckpt["optimizer"]["state"].items():  # Adam's load checks no shape
            for key, value in state.items():
                if isinstance(value, Tensor) and value.dim() and value.shape != params[index].shape:
                    raise ValueError(
                        f"the optimizer state {key!r} of parameter {index} has shape "
                        f"{tuple(value.shape)}, the parameter {tuple(params[index].shape)}"
                    )
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


def read_train_directory(
    path: str | os.PathLike[str], build_model: Callable[[int], nn.Module]
) -> dict[str, Any]:
    """The reader of a checkpoint directory: every item's checksum verified (in this process
    alone), the model and optimizer items checked against the model its ``args`` describe.
    Returns the ``extra`` (``format``, ``epoch``, ``args``) and ``sharded``, the path."""
    try:
        storage.verify(path)
        extra = storage.read_objects(path, ["extra"])["extra"]
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {path}: {_first_line(e)}") from e
    extra = _train_dict(path, extra)
    model = build_model(int(extra["args"]["hidden"]))
    keys = storage.read_keys(path)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    unknown = []
    for key, meta in sorted(keys.items()):
        split = split_state_key(key)  # the parameter a model or state item is of
        name = split[0] if split is not None else key.removeprefix(MODEL_PREFIX)
        if key.startswith(STATE_PREFIX) and name not in shapes:
            unknown.append(key)
        elif name in shapes and meta is not None and meta[0] not in ((), shapes[name]):
            raise CheckpointError(
                f"checkpoint {path} does not fit the demo MLP: {key} has shape {meta[0]}, the "
                f"model's {name} {shapes[name]}"
            )
    if unknown or any(model_key(n) not in keys for n in shapes):
        raise CheckpointError(
            f"checkpoint {path} does not fit the demo MLP (hidden {extra['args']['hidden']}): "
            f"{unknown[:3] or 'model tensors are missing'}"
        )
    return {**extra, "sharded": str(path)}
