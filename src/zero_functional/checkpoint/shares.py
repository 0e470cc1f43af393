"""A snapshot on disk: each rank's share a checkpoint of its own, copies on other nodes, read as one.

A node's snapshot directory holds ``step-<S>/`` per snapshot, and in it ``share-<q>-of-<W>/``
(what rank ``q`` of a world of ``W`` wrote) or ``copy-<q>-of-<W>/`` (the copy another rank
keeps of it): each one :func:`~.storage.write_alone` directory (a CRC32 per item) with its
manifest (:func:`seal`). :func:`inventory` lists the usable shares,
skipping, by name, a file that fails its checksum; :func:`newest_complete` picks the newest step
whose every share some node holds; :func:`assemble` links one step's shares into a directory
whose merged index (:func:`merge_indexes`) :func:`zero_functional.checkpoint.load` reads at any
world size. Which rank keeps whose copy is :func:`partners`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import Any

import torch  # noqa: F401 - the doctests' tensors
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from zero_functional.checkpoint import storage
from zero_functional.checkpoint.storage import CheckpointError

STEP_RE = re.compile(r"^step-(\d+)$")
SHARE_RE = re.compile(r"^(share|copy)-(\d+)-of-(\d+)$")

Key = tuple[int, int]
"""A snapshot: its step and the world size that took it."""


def step_name(step: int) -> str:
    """The directory of the snapshot of ``step`` in a node's snapshot directory.

    Example:
        >>> step_name(120)
        'step-120'
    """
    return f"step-{step}"


def share_name(rank: int, world_size: int, copy: bool = False) -> str:
    """The directory of rank ``rank``'s share (``copy``: another rank's copy of it).

    Example:
        >>> share_name(1, 4), share_name(1, 4, copy=True)
        ('share-1-of-4', 'copy-1-of-4')
    """
    return f"{'copy' if copy else 'share'}-{rank}-of-{world_size}"


def partners(nodes: Sequence[Hashable]) -> list[int | None]:
    """Per rank, the rank that keeps the copy of its share: the next node's rank with the same
    place among its node's ranks (modulo that node's count); on one node, the next rank;
    ``None`` for a world of one. ``nodes[r]`` is rank ``r``'s node, in any hashable form.

    Example:
        >>> partners(["a", "a", "b", "b"]), partners(["a", "a", "a"]), partners(["a"])
        ([2, 3, 0, 1], [1, 2, 0], [None])
    """
    if len(nodes) == 1:
        return [None]
    order: dict[Hashable, list[int]] = {}
    for rank, node in enumerate(nodes):
        order.setdefault(node, []).append(rank)
    groups = list(order.values())
    at = {node: i for i, node in enumerate(order)}
    place = {rank: i for ranks in groups for i, rank in enumerate(ranks)}
    step = 0 if len(groups) == 1 else 1  # to the next node; on one node, the next rank there
    out: list[int | None] = []
    for rank, node in enumerate(nodes):
        there = groups[(at[node] + step) % len(groups)]
        out.append(there[(place[rank] + 1 - step) % len(there)])
    return out


MANIFEST = ".share.json"


def seal(directory: str, rank: int, world_size: int) -> None:
    """Record in ``directory`` whose share it holds and each of its files' size (the bytes'
    checksums are the items' own, :func:`~.storage.write_alone`'s): what :func:`check_share`
    checks. Flushed to disk.

    Example:
        >>> import os, tempfile
        >>> share = os.path.join(tempfile.mkdtemp(), share_name(0, 1))
        >>> storage.write_alone(share, {"w": ((2,), torch.float32, [(0, 2, torch.ones(2))])}, {}, None)
        >>> seal(share, 0, 1); check_share(share) is None
        True
    """
    files = {n: os.path.getsize(os.path.join(directory, n)) for n in sorted(os.listdir(directory))}
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump({"rank": rank, "world_size": world_size, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())


def check_share(directory: str) -> str | None:
    """Why the share in ``directory`` cannot be used (its manifest missing or unreadable, a file
    missing or of another size, an item failing its CRC32), naming the file; ``None`` if it can.

    Example:
        >>> import tempfile
        >>> check_share(tempfile.mkdtemp() + "/share-0-of-1")
        'no such directory: ...share-0-of-1'
    """
    if not os.path.isdir(directory) or SHARE_RE.match(os.path.basename(directory)) is None:
        return f"no such directory: {directory}"
    manifest = os.path.join(directory, MANIFEST)
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{manifest} is missing or unreadable ({e})"
    for name, size in sorted(files.items()):
        path = os.path.join(directory, name)
        if (got := os.path.getsize(path) if os.path.isfile(path) else None) != size:
            return f"{path} is {'missing' if got is None else f'{got} bytes'}, not {size}"
    try:
        storage.verify(directory)  # every item's checksum
    except CheckpointError as e:
        return f"{directory}: {e}"
    return None


def inventory(snapshot_dir: str) -> tuple[dict[Key, dict[int, str]], list[str]]:
    """The usable shares in a node's snapshot directory, by snapshot and rank (a share before
    a copy of it), and one line per share or copy skipped (why, naming the file).

    Example:
        >>> import tempfile
        >>> inventory(tempfile.mkdtemp())
        ({}, [])
    """
    found: dict[Key, dict[int, str]] = {}
    skipped: list[str] = []
    steps = os.listdir(snapshot_dir) if os.path.isdir(snapshot_dir) else []
    for step_dir in sorted(steps):
        if (step := STEP_RE.match(step_dir)) is None:
            continue
        names = os.listdir(os.path.join(snapshot_dir, step_dir))
        for name in sorted(names, key=lambda n: n.startswith("copy")):  # shares first
            if (m := SHARE_RE.match(name)) is None:
                continue
            key, rank = (int(step[1]), int(m[3])), int(m[2])
            path = os.path.join(snapshot_dir, step_dir, name)
            if rank in found.get(key, {}):
                continue
            if (why := check_share(path)) is not None:
                skipped.append(why)
            else:
                found.setdefault(key, {})[rank] = path
    return found, skipped


def newest_complete(
    held: Sequence[Mapping[Key, Collection[int]]], min_step: int | None
) -> Key | None:
    """The newest snapshot (step, world size) whose every rank's share one of ``held`` (each
    node's usable shares: rank to anything) has, at ``min_step`` or later; ``None`` if none.

    Example:
        >>> newest_complete([{(20, 2): {0: "a"}, (10, 2): {0: "a"}}, {(10, 2): {1: "b"}}], None)
        (10, 2)
        >>> newest_complete([{(10, 2): {0: "a", 1: "b"}}], min_step=11) is None
        True
    """
    keys = sorted({k for node in held for k in node}, reverse=True)
    for step, world in keys:
        have = {rank for node in held for rank in node.get((step, world), ())}
        if have >= set(range(world)) and (min_step is None or step >= min_step):
            return step, world
    return None


def merge_indexes(indexes: Sequence[tuple[str, Metadata]]) -> Metadata:
    """One index over several checkpoints' files, each given with the folder its files will be
    read from (relative to the merged directory): their tensors' chunks side by side, a chunk
    or an object several hold taken once, from the first (they must agree byte for byte).

    Raises:
        CheckpointError: Two indexes that disagree (a key's kind, shape or dtype, or the bytes
            of a chunk or an object both hold).

    Example:
        >>> import os, tempfile
        >>> root = tempfile.mkdtemp()
        >>> for r in (0, 1):
        ...     piece = {"w": ((4,), torch.float32, [(2 * r, 2 * r + 2, torch.ones(2))])}
        ...     storage.write_alone(os.path.join(root, str(r)), piece, {"n": 1}, None)
        >>> merged = merge_indexes([(str(r), storage.read_index(os.path.join(root, str(r)))) for r in (0, 1)])
        >>> [tuple(c.offsets) for c in merged.state_dict_metadata["w"].chunks]
        [(0,), (2,)]
    """
    tensors: dict[str, TensorStorageMetadata] = {}
    chunks: dict[str, dict[tuple[int, ...], ChunkStorageMetadata]] = {}
    objects: dict[str, BytesStorageMetadata] = {}
    data: dict[MetadataIndex, Any] = {}
    for folder, index in indexes:
        for key, meta in index.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata):
                have = tensors.setdefault(key, meta)
                if key in objects or (have.size, have.properties.dtype) != (
                    meta.size,
                    meta.properties.dtype,
                ):
                    raise CheckpointError(f"the shares disagree on what {key!r} is")
                for c in meta.chunks:
                    chunks.setdefault(key, {}).setdefault(tuple(c.offsets), c)
            elif key in tensors:
                raise CheckpointError(f"the shares disagree on what {key!r} is")
            else:
                objects.setdefault(key, meta)
        for at, info in index.storage_data.items():
            where = MetadataIndex(at.fqn, at.offset)
            if (first := data.get(where)) is None:
                data[where] = moved = copy.copy(info)  # its checksum attribute too
                moved.relative_path = f"{folder}/{info.relative_path}"
            elif storage.item_checksum(first) != storage.item_checksum(info):
                raise CheckpointError(
                    f"the shares disagree on {at.fqn!r} (at {tuple(at.offset or ())}): every "
                    "rank must snapshot the same value"
                )
    merged: dict[str, STORAGE_TYPES] = {
        k: dataclasses.replace(t, chunks=list(chunks[k].values())) for k, t in tensors.items()
    }
    return dataclasses.replace(
        indexes[0][1],
        state_dict_metadata={**merged, **objects},
        storage_data=data,
        planner_data=None,
    )


def assemble(view: str, shares: Mapping[int, str]) -> None:
    """Make ``view`` a checkpoint of the shares (rank to its directory): a link to each, and
    their merged index.

    Raises:
        CheckpointError: The shares' indexes disagree, or one cannot be read.

    Example:
        >>> import os, tempfile
        >>> root = tempfile.mkdtemp()
        >>> paths = {r: os.path.join(root, share_name(r, 2)) for r in (0, 1)}
        >>> for r, path in paths.items():
        ...     piece = {"w": ((4,), torch.float32, [(2 * r, 2 * r + 2, torch.full((2,), float(r)))])}
        ...     storage.write_alone(path, piece, {}, None)
        >>> assemble(os.path.join(root, "view"), paths)
        >>> storage.load_pieces(os.path.join(root, "view"), {"w": ((4,), torch.float32, [(0, 4)])})[0]
        {'w': [tensor([0., 0., 1., 1.])]}
    """
    os.makedirs(view)
    indexes = []
    for rank in sorted(shares):
        os.symlink(os.path.abspath(shares[rank]), os.path.join(view, str(rank)))
        indexes.append((str(rank), storage.read_index(shares[rank])))
    storage.write_index(view, merge_indexes(indexes))
