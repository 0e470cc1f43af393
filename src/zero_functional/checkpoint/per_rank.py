"""Checkpoints without a shared file system (``save(..., shared=False)``: Ray Train, pods).

Each rank writes into its own directory only its own files (DCP's names are unique to a rank;
rank 0 adds the index), then its manifest :data:`MANIFEST` (the save's id, its rank, the world
size, each file's size and CRC32), and commits it. The ranks' directories merged into one (Ray
Train does it) are a checkpoint ``load`` reads at any world size, once :func:`check_parts` has
found every rank's part of one save there.

Example:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> write_manifest(d, "abc", 0, 2)
    >>> check_parts(d)
    Traceback (most recent call last):
    ...
    zero_functional.checkpoint.storage.CheckpointError: the checkpoint in ... is missing rank 1's part (ranks 0-1 of 2 saved it with shared=False): merge every rank's directory into it
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Mapping
from typing import cast

import torch.distributed as dist

from zero_functional import comm
from zero_functional.checkpoint import atomic_dir, storage
from zero_functional.checkpoint.storage import CheckpointError, Pieces
from zero_functional.core._validate import first_of

MANIFEST = ".rank-{rank}-of-{world}.json"
"""Each rank's manifest in a ``shared=False`` checkpoint."""
_MANIFEST_RE = re.compile(r"^\.rank-(\d+)-of-(\d+)\.json$")


def write_manifest(directory: str, save_id: str, rank: int, world_size: int) -> None:
    """Write rank ``rank``'s manifest into ``directory``: the save's id and each file there
    (but manifests and the save marker) with its size and CRC32; flushed to disk."""
    files = {}
    for name in sorted(os.listdir(directory)):
        if name != atomic_dir.MARKER and not _MANIFEST_RE.match(name):
            crc, size = atomic_dir.file_crc(os.path.join(directory, name))
            files[name] = {"size": size, "crc32": f"{crc:08x}"}
    body = {"save": save_id, "rank": rank, "world_size": world_size, "files": files}
    path = os.path.join(directory, MANIFEST.format(rank=rank, world=world_size))
    with open(path, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def check_parts(path: str | os.PathLike[str]) -> None:
    """Raise a :class:`~zero_functional.checkpoint.storage.CheckpointError` unless the
    ``shared=False`` checkpoint at ``path`` holds every rank's part of one save (every
    manifest, one save id, each listed file of its size); nothing where there are no manifests."""
    directory = os.fspath(path)
    if not os.path.isdir(directory):
        return  # the reader names a missing directory
    found: dict[int, tuple[int, dict[str, object]]] = {}
    for name in os.listdir(directory):
        m = _MANIFEST_RE.match(name)
        if m:
            try:
                with open(os.path.join(directory, name)) as f:
                    found[int(m.group(1))] = (int(m.group(2)), json.load(f))
            except (OSError, ValueError) as e:
                raise CheckpointError(f"cannot read the manifest {name} in {directory}: {e}") from e
    if not found:
        return
    worlds = {w for w, _ in found.values()}
    saves = {str(body.get("save")) for _, body in found.values()}
    if len(worlds) > 1 or len(saves) > 1:
        raise CheckpointError(
            f"the checkpoint in {directory} mixes parts of different saves (manifests of "
            f"{len(saves)} saves, world sizes {first_of(sorted(worlds))}): merge the "
            "directories of one save"
        )
    (world,) = worlds
    missing = [r for r in range(world) if r not in found]
    if missing:
        whose = (
            f"rank {missing[0]}'s part"
            if len(missing) == 1
            else f"ranks {first_of(missing)}'s parts"
        )
        raise CheckpointError(
            f"the checkpoint in {directory} is missing {whose} (ranks 0-{world - 1} of {world} "
            "saved it with shared=False): merge every rank's directory into it"
        )
    for rank, (_, body) in sorted(found.items()):
        for name, info in cast(Mapping[str, Mapping[str, object]], body["files"]).items():
            file = os.path.join(directory, name)
            size = os.path.getsize(file) if os.path.isfile(file) else None
            if size != info["size"]:
                got = "missing" if size is None else f"{size} bytes"
                raise CheckpointError(
                    f"rank {rank}'s file {file} is {got} but {info['size']} bytes were saved: "
                    "the merged checkpoint is incomplete or was overwritten"
                )


def save_pieces(
    path: str | os.PathLike[str],
    pieces: Pieces,
    objects: Mapping[str, object],
    process_group: dist.ProcessGroup | None,
    *,
    max_box_numel: int | None,
) -> None:
    """:func:`~zero_functional.checkpoint.storage.save_pieces` into this rank's own directory
    ``path`` (every rank's differs), with its manifest; collective (an
    :class:`~zero_functional.checkpoint.storage.AtomicSave` of its own on each rank).

    Raises:
        CheckpointError: On every rank, naming each rank's cause (a refused target, two ranks
            given one directory, a failed write or commit); every rank's previous checkpoint
            at its ``path`` is untouched.
    """
    world = comm.group_size(comm.default_group(process_group))
    with storage.AtomicSave(path, process_group, own=True) as save:
        save_id = cast(str, comm.broadcast_object(uuid.uuid4().hex, process_group))
        storage.write_dcp(save.tmp, pieces, objects, process_group, max_box_numel)
        write_manifest(save.tmp, save_id, comm.rank_or_zero(process_group), world)
