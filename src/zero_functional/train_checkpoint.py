"""The demo train job's checkpoints: written atomically, checked before a run resumes from them.

Two kinds: a sharded directory (``zero_functional.checkpoint``; what the job writes with ours) and
one consolidated ``torch.save`` file (what ``--impl torch`` and earlier versions write). Both are
checked against the demo MLP their own ``args`` describe, so a bad one is refused in one line
before any rank starts. Every name here is also importable from :mod:`zero_functional.train`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from zero_functional.storage import CheckpointError

__all__ = ["CHECKPOINT_FORMAT", "CheckpointError", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_FORMAT = "zero_functional.train/1"
"""The ``format`` key of the checkpoints this job writes; others are refused on resume."""


def save_checkpoint(path: str | os.PathLike[str], payload: Mapping[str, object]) -> None:
    """Write ``payload`` with ``torch.save`` atomically: a crash mid-write keeps the old file.

    The bytes go to a temporary file in the same directory, are flushed to disk, and then
    ``os.replace`` renames it over ``path`` (atomic on POSIX and Windows).
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


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a checkpoint written by this job: a sharded directory, or an older file.

    For a directory (``zero_functional.checkpoint``), every stored item's checksum is verified
    and its model and optimizer state are checked against the MLP its own ``args`` describe;
    the result holds ``epoch``, ``args`` and ``sharded`` (the path). For a single file (what
    earlier versions wrote, and ``--impl torch`` writes), the zip archive's CRCs are verified and
    the result also holds ``model`` and ``optimizer``.

    Raises:
        CheckpointError: Missing, corrupt, not this job's format, or not this job's model.
    """
    p = Path(path)
    if p.is_dir():
        return _load_sharded(p)
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
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {p} was not written by `zero-functional train --checkpoint` "
            f"(no format {CHECKPOINT_FORMAT!r})"
        )
    missing = {"model", "optimizer", "epoch", "args"} - ckpt.keys()
    if missing:
        raise CheckpointError(f"checkpoint {p} lacks {sorted(missing)}; it is truncated or edited")
    from zero_functional.train import build_model  # the job's module imports this one

    try:
        model = build_model(int(ckpt["args"]["hidden"]))
        model.load_state_dict(ckpt["model"])
        torch.optim.Adam(model.parameters()).load_state_dict(ckpt["optimizer"])
        _check_optimizer_shapes(model, ckpt["optimizer"])
    except Exception as e:
        raise CheckpointError(f"checkpoint {p} does not fit the demo MLP: {_first_line(e)}") from e
    return dict(ckpt)


def _check_optimizer_shapes(model: nn.Module, state_dict: Mapping[str, Any]) -> None:
    params = list(model.parameters())
    for index, state in state_dict["state"].items():
        for key, value in state.items():
            if isinstance(value, Tensor) and value.dim() and value.shape != params[index].shape:
                raise ValueError(
                    f"the optimizer state {key!r} of parameter {index} has shape "
                    f"{tuple(value.shape)}, the parameter {tuple(params[index].shape)}"
                )


def _load_sharded(path: Path) -> dict[str, Any]:
    from zero_functional import storage
    from zero_functional.train import build_model

    try:
        storage.verify(path)
        extra = storage.read_objects(path, ["extra"])["extra"]
    except storage.CheckpointError as e:
        raise CheckpointError(f"checkpoint {path}: {_first_line(e)}") from e
    if not isinstance(extra, dict) or extra.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {path} was not written by `zero-functional train --checkpoint` "
            f"(no format {CHECKPOINT_FORMAT!r})"
        )
    model = build_model(int(extra["args"]["hidden"]))
    keys = storage.read_keys(path)
    names = [name for name, _ in model.named_parameters()]
    for name, p in model.named_parameters():
        for key, meta in keys.items():
            if key == f"model.{name}" or key.startswith(f"state.{name}."):
                if meta is not None and meta[0] not in ((), tuple(p.shape)):
                    raise CheckpointError(
                        f"checkpoint {path} does not fit the demo MLP: {key} has shape "
                        f"{meta[0]}, the model's {name} {tuple(p.shape)}"
                    )
    unknown = sorted(
        k
        for k in keys
        if k.startswith("state.") and k[len("state.") :].rsplit(".", 1)[0] not in names
    )
    if unknown or any(f"model.{n}" not in keys for n in names):
        raise CheckpointError(
            f"checkpoint {path} does not fit the demo MLP (hidden {extra['args']['hidden']}): "
            f"{unknown[:3] or 'model tensors are missing'}"
        )
    return {**extra, "sharded": str(path)}
