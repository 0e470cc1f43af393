"""Sharded, checksummed, atomic tensor storage on ``torch.distributed.checkpoint`` (DCP).

:func:`save_pieces` writes what this rank holds of each global tensor (flat row-major ranges,
as the N-d boxes they cover: no copies, no padding) and small objects, through
:class:`AtomicSave`, the one save protocol; :func:`load_pieces` reads the ranges a rank asks
for, whatever ranges were saved, after checking everything. Every item has a CRC32, so a
flipped or truncated byte is a :class:`CheckpointCorruptError`, never NaN state. The files are
DCP's format: its stock readers read them unchanged.

Without a shared file system (``shared=False``: Ray Train, pods) each rank commits its own
directory: its own files (DCP's names are unique to a rank; rank 0 adds the index) and its
manifest (:func:`write_manifest`). Merged into one (Ray Train does it), the ranks' directories
are a checkpoint that reads at any world size once :func:`check_parts` finds every rank's part.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import pickle
import re
import uuid
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import IO, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemReader,
    FileSystemWriter,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from zero_functional import comm
from zero_functional.checkpoint import atomic_dir
from zero_functional.core._validate import by_rank, first_of
from zero_functional.core.layout import Box, flat_range_boxes

Pieces = Mapping[str, tuple[Sequence[int], torch.dtype, Sequence[tuple[int, int, Tensor]]]]
"""Per key: the global shape, the dtype, and the ``(start, stop, 1-D tensor)`` ranges held."""
Wanted = Mapping[str, tuple[Sequence[int], torch.dtype, Sequence[tuple[int, int]]]]
"""Per key: the global shape, the dtype, and the ``(start, stop)`` ranges to read."""
Saved = Mapping[str, tuple[tuple[int, ...], torch.dtype] | None]
"""A checkpoint's keys: ``(shape, dtype)`` for a tensor, ``None`` for an object."""

DEFAULT_MAX_BOX_NUMEL = 1 << 22
"""No stored chunk holds more elements: what bounds memory while saving (one chunk at a time)
and loading (at most two chunks beyond the output)."""

_MANIFEST_RE = re.compile(r"^\.rank-(\d+)-of-(\d+)\.json$")  # each rank's (shared=False)
_CRC_ATTR = "zf_crc32"  # pickled with each _StorageInfo in .metadata; stock readers ignore it


class CheckpointError(RuntimeError, ValueError):
    """A checkpoint could not be saved, loaded or resumed from; the message names the file (or
    each rank's cause, raised on every rank). Both a ``RuntimeError`` and a ``ValueError``."""


class CheckpointCorruptError(CheckpointError):
    """The bytes on disk are not what was written (a checksum mismatch, a truncated file)."""


def box_views(
    shape: Sequence[int], start: int, stop: int, flat: Tensor, max_numel: int | None = None
) -> list[tuple[Box, Tensor]]:
    """The row-major boxes the range ``[start, stop)`` of a tensor of ``shape`` covers, each
    with its view into ``flat`` (the range's elements; no copy).

    Example:
        >>> [(box, view.tolist()) for box, view in box_views((2, 3), 2, 5, torch.arange(3))]
        [(((0, 2), (1, 1)), [[0]]), (((1, 0), (1, 2)), [[1, 2]])]
    """
    return [
        (box, flat.narrow(0, first - start, math.prod(box[1])).view(box[1]))
        for box, first in flat_range_boxes(shape, start, stop, max_numel=max_numel)
    ]


def _digest(obj: object) -> str:
    if isinstance(obj, Tensor):  # its bytes: cheaper than torch.save's archive
        raw = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return f"{obj.dtype}{tuple(obj.shape)}:{zlib.crc32(raw.numpy().tobytes()):08x}"
    buf = io.BytesIO()
    torch.save(obj, buf)
    return f"{zlib.crc32(buf.getbuffer()):08x}:{buf.tell()}"


class _BoxSavePlanner(DefaultSavePlanner):
    """DCP's save planner plus one SHARD item per box; its checks run inside DCP's
    exception-safe local step, so a bad input on one rank fails every rank, not a hang."""

    def __init__(self, pieces: Pieces, max_box_numel: int | None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._pieces, self._cap = pieces, max_box_numel
        self._views: dict[MetadataIndex, Tensor] = {}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()  # BYTE_IO items for the objects
        # DCP keeps one of several ranks' copies of a key without looking at them: ship a digest
        # of each (objects, scalars), so the coordinator refuses copies that disagree
        digests: dict[str, object] = {k: _digest(v) for k, v in self.state_dict.items()}
        items: list[WriteItem] = []
        for key, (shape_seq, dtype, ranges) in self._pieces.items():
            shape = torch.Size(shape_seq)
            boxes: list[tuple[Box, Tensor]] = []
            if math.prod(shape) == 0:  # one empty whole chunk, so that the key exists
                boxes.append((((0,) * len(shape), tuple(shape)), torch.empty(shape, dtype=dtype)))
            for start, stop, local in ranges:
                local = local.reshape(1) if local.dim() == 0 else local
                if local.dim() != 1 or local.numel() != stop - start or local.dtype != dtype:
                    raise CheckpointError(
                        f"{key}: the piece [{start}, {stop}) is {tuple(local.shape)} {local.dtype}, "
                        f"expected ({stop - start},) {dtype}"
                    )
                boxes += box_views(shape, start, stop, local, self._cap)
            for (offsets, sizes), view in boxes:
                index = MetadataIndex(key, offsets)
                if index in self._views:
                    raise CheckpointError(f"{key}: the box at {offsets} is given twice")
                self._views[index] = view
                if view.dim() == 0:
                    digests[key] = _digest(view)
                chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                data = TensorWriteData(chunk, TensorProperties(dtype=dtype), shape)
                items.append(WriteItem(index, WriteItemType.SHARD, tensor_data=data))
        self.plan = dataclasses.replace(plan, items=plan.items + items, planner_data=digests)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        seen: dict[str, tuple[int, object]] = {}
        for rank, plan in enumerate(all_plans):
            for key, digest in (plan.planner_data or {}).items():
                first = seen.setdefault(key, (rank, digest))
                if first[1] != digest:
                    raise CheckpointError(
                        f"{key!r} is written by several ranks, and ranks {first[0]} and {rank} "
                        "hold different values: every rank must save the same value"
                    )
        plans = [dataclasses.replace(p, planner_data=None) for p in all_plans]
        return super().create_global_plan(plans)

    def lookup_object(self, index: MetadataIndex) -> Any:
        view = self._views.get(index)
        return view if view is not None else super().lookup_object(index)


class _BoxLoadPlanner(DefaultLoadPlanner):
    """Reads exactly the saved chunks that overlap this rank's boxes, after checking everything."""

    def __init__(
        self, wanted: Wanted, boxes: Mapping[str, list[tuple[Box, Tensor]]], objects: Sequence[str]
    ) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._wanted, self._objects = wanted, list(objects)
        self._boxes = boxes  # each box with its view into the fresh buffer that receives it

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        errors: list[str] = []
        if missing := [k for k in [*self._objects, *self._wanted] if k not in saved]:
            errors.append(f"it has no {first_of(missing)}")
        for k in self._objects:
            if k in saved and not isinstance(saved[k], BytesStorageMetadata):
                errors.append(f"{k!r} is a tensor there, not an object")
        for k, (shape, dtype, _) in self._wanted.items():
            if (meta := saved.get(k)) is None:
                continue
            if not isinstance(meta, TensorStorageMetadata):
                errors.append(f"{k!r} is an object there, not a tensor")
            elif meta.size != torch.Size(shape) or meta.properties.dtype != dtype:
                errors.append(
                    f"{k!r} is {tuple(meta.size)} {meta.properties.dtype} there, but "
                    f"{tuple(shape)} {dtype} here"
                )
        if errors:
            raise CheckpointError("the checkpoint does not fit: " + "; ".join(errors))
        items = list(super().create_local_plan().items)  # the objects' reads
        for k, boxes in self._boxes.items():
            if not boxes:
                continue
            chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for (o, s), _ in boxes]
            meta = cast(TensorStorageMetadata, saved[k])
            reads = create_read_items_for_chunk_list(k, meta, chunks)
            covered = [0] * len(chunks)
            for r in reads:
                assert r.dest_index.index is not None
                covered[r.dest_index.index] += math.prod(r.lengths)
            for ((offsets, sizes), _), got in zip(boxes, covered):
                if got != math.prod(sizes):
                    raise CheckpointCorruptError(
                        f"{k!r}: the checkpoint holds {got} of the {math.prod(sizes)} elements "
                        f"at offsets {offsets}: a rank's pieces were not saved"
                    )
            items += reads
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        boxes = self._boxes.get(index.fqn)
        if boxes is not None and index.index is not None:
            return boxes[index.index][1]
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # weights_only: a checkpoint is data, never code (DCP's own default unpickles anything)
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


class _CrcStream(io.RawIOBase):
    """Write-through to a file, keeping the CRC32 and count of what went through."""

    def __init__(self, raw: io.BufferedWriter) -> None:
        super().__init__()
        self.raw, self.crc = raw, 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.raw.write(view)
        return view.nbytes

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:  # never closes the file underneath
        self.flush()


class _ChecksummedWriter(FileSystemWriter):
    """DCP's file format, one item at a time (no second copy of the state), a CRC32 per item."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assert plan.storage_data is not None
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        file = os.path.join(str(self.path), name)
        results: list[WriteResult] = []
        try:
            with open(file, "wb") as f:
                for item in plan.items:
                    data, offset, stream = planner.resolve_data(item), f.tell(), _CrcStream(f)
                    if item.type == WriteItemType.BYTE_IO:
                        stream.write(cast(io.BytesIO, data).getbuffer())
                    else:
                        t = cast(Tensor, data).detach().cpu()
                        if t.untyped_storage().nbytes() != t.nbytes:
                            t = t.clone()  # torch.save writes whole storages: copy just the box
                        torch.save(t, cast(IO[bytes], stream))
                        del t
                    del data
                    info = _StorageInfo(name, offset, f.tell() - offset)
                    setattr(info, _CRC_ATTR, stream.crc)
                    results.append(WriteResult(item.index, info.length, info))
                f.flush()
                if self.sync_files:
                    os.fsync(f.fileno())
        except (OSError, RuntimeError) as e:  # torch.save's zip writer hides an OSError
            raise CheckpointError(f"cannot write {file}: {atomic_dir.os_error(e) or e}") from e
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        _write_index_crc(os.path.join(str(self.path), ".metadata"))


def _write_index_crc(path: str) -> None:
    """Record the index file's CRC32 and length beside it (``.metadata.crc32``), flushed."""
    crc, n = atomic_dir.file_crc(path)
    with open(path + ".crc32", "w") as f:
        f.write(f"{crc:08x} {n}\n")
        f.flush()
        os.fsync(f.fileno())


class _ChecksummedReader(FileSystemReader):
    """Reads each needed item once, checks its length and CRC32, then deserialises it."""

    _metadata_error: CheckpointCorruptError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # dcp.load swallows what this raises (and fails with a bare AssertionError): keep the
        # error and raise it from set_up_storage_reader, which DCP passes on as it is
        path = os.path.join(str(self.path), ".metadata")
        try:
            with open(path + ".crc32") as f:
                want_crc, want_n = f.read().split()
            got_crc, got_n = atomic_dir.file_crc(path)
            if (got_crc, got_n) != (int(want_crc, 16), int(want_n)):
                raise CheckpointCorruptError(
                    f"{path} has crc32 {got_crc:08x} ({got_n} bytes) but {want_crc} "
                    f"({want_n} bytes) was recorded: the checkpoint's index is corrupt"
                )
        except (OSError, ValueError) as e:  # a CheckpointCorruptError too: it is a ValueError
            self._metadata_error = CheckpointCorruptError(f"cannot verify {path}: {e}")
        if self._metadata_error is not None:
            return Metadata(state_dict_metadata={}, storage_data={})
        return super().read_metadata(*args, **kwargs)

    def set_up_storage_reader(self, *args: Any, **kwargs: Any) -> None:
        if self._metadata_error is not None:
            raise self._metadata_error
        super().set_up_storage_reader(*args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        requests: dict[MetadataIndex, list[ReadItem]] = {}
        for req in plan.items:
            requests.setdefault(req.storage_index, []).append(req)
        for index, raw in _checked_items(str(self.path), self.storage_data, requests):
            if requests[index][0].type == LoadItemType.BYTE_IO:
                for req in requests[index]:
                    planner.load_bytes(req, io.BytesIO(raw))
                continue
            stored = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            del raw  # at most two chunks beyond the output: this one and the next one's bytes
            for req in requests[index]:
                src = stored
                for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                    src = src.narrow(d, o, n)
                dst = planner.resolve_tensor(req).detach()
                dst.copy_(src)
                planner.commit_tensor(req, dst)
            del stored
        done: Future[None] = Future()
        done.set_result(None)
        return done


def item_checksum(info: _StorageInfo) -> tuple[int | None, int]:
    """An index entry's recorded CRC32 (``None``: none recorded) and length.

    Example:
        >>> item_checksum(_StorageInfo("__0_0.distcp", 0, 12))
        (None, 12)
    """
    return getattr(info, _CRC_ATTR, None), info.length


def _checked(f: io.BufferedReader, where: str, info: _StorageInfo) -> bytes:
    """One item's bytes, their length and CRC32 checked."""
    f.seek(info.offset)
    raw = f.read(info.length)
    span = f"bytes [{info.offset}, {info.offset + info.length})"
    if len(raw) != info.length:
        size = os.fstat(f.fileno()).st_size
        raise CheckpointCorruptError(
            f"{where} needs {span} but the file has {size}: the checkpoint is truncated"
        )
    if (expected := getattr(info, _CRC_ATTR, None)) is None:
        raise CheckpointCorruptError(f"{where} has no recorded checksum")
    if (got := zlib.crc32(raw)) != expected:
        raise CheckpointCorruptError(
            f"{where}, {span}: crc32 {got:08x} but {expected:08x} was recorded: the checkpoint "
            "is corrupt"
        )
    return raw


def _checked_items(
    root: str, storage: Mapping[MetadataIndex, _StorageInfo], indices: Iterable[MetadataIndex]
) -> Iterator[tuple[MetadataIndex, bytes]]:
    """The items' checked bytes, file by file in offset order (each file opened once)."""
    by_file: dict[str, list[MetadataIndex]] = {}
    for index in indices:
        by_file.setdefault(storage[index].relative_path, []).append(index)
    for relative, items in by_file.items():
        file = os.path.join(root, relative)
        if not os.path.exists(file):
            raise CheckpointCorruptError(f"the checkpoint file {file} is missing")
        with open(file, "rb") as f:
            for index in sorted(items, key=lambda i: storage[i].offset):
                where = f"{index.fqn} at offsets {tuple(index.offset or ())} in {relative}"
                yield index, _checked(f, where, storage[index])


@contextlib.contextmanager
def dcp_errors(step: str) -> Iterator[None]:
    """DCP's ``CheckpointException`` (a BaseException) as one error naming each failed rank."""
    try:
        yield
    except CheckpointException as e:
        failures = sorted(e.failures.items())
        corrupt = any(isinstance(exc, CheckpointCorruptError) for _, (exc, _) in failures)
        kind = CheckpointCorruptError if corrupt else CheckpointError
        by = by_rank([(r, str(exc)) for r, (exc, _) in failures])
        raise kind(f"checkpoint {step} failed: {by}") from None


def dcp_parts(
    tmp: str, pieces: Pieces, max_box_numel: int | None
) -> tuple[SavePlanner, FileSystemWriter]:
    """DCP's planner and writer of ``pieces`` into the directory ``tmp`` (a CRC32 per item)."""
    writer = _ChecksummedWriter(tmp, sync_files=True, overwrite=False)
    return _BoxSavePlanner(pieces, max_box_numel), writer


class AtomicSave:
    """One atomic save: a marked temporary beside ``path``, written, committed, one verdict.

    The shared, the per-rank (``own=True``: each rank into its own directory) and the background
    saves all enter it. Making it refuses a ``path`` :func:`~.atomic_dir.refusal` refuses, on
    every rank, before anything is written. Leaving the block commits :attr:`tmp` (shared: rank
    0; own: each rank) and agrees on the verdict: every rank returns once the checkpoint is in
    place, or raises naming each rank's cause, the temporary discarded and the previous
    checkpoint untouched; a background save :meth:`hand_off` s the commit to its thread.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> with AtomicSave(path, group) as save:
        ...     open(os.path.join(save.tmp, "data"), "w").close()
        >>> sorted(os.listdir(path))
        ['.zero_functional-save', 'data']
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        process_group: dist.ProcessGroup | None,
        *,
        own: bool = False,
    ) -> None:
        self.target = os.path.abspath(os.fspath(path))
        self.group, self.own = process_group, own
        self.holds = own or comm.rank_or_zero(process_group) == 0  # makes tmp and commits it
        self._handed_off = False
        tmp, reason = self._temporary() if self.holds else ("", None)
        if own:
            reason = self._refusals(reason)
        else:  # rank 0 decided for every rank
            agreed = comm.broadcast_object((tmp, reason), process_group)
            tmp, reason = cast(tuple[str, "str | None"], agreed)
        if reason is not None:
            if tmp and self.holds:
                atomic_dir.discard(tmp)
            raise CheckpointError(f"checkpoint save refused, nothing written: {reason}")
        self.tmp = tmp

    def _temporary(self) -> tuple[str, str | None]:
        """The temporary this rank makes beside the target, or why it may not."""
        if (reason := atomic_dir.refusal(self.target)) is not None:
            return "", reason
        try:
            return atomic_dir.make_temporary(self.target), None
        except OSError as e:
            return "", f"cannot create a directory beside {self.target} ({e}); pass a writable path"

    def _refusals(self, reason: str | None) -> str | None:
        """Every rank's refusal, and ranks given one directory, as one reason (or ``None``)."""
        seen = comm.all_gather_objects((self.target, reason), comm.default_group(self.group))
        pairs = cast(list[tuple[str, "str | None"]], seen)
        problems = [(r, why) for r, (_, why) in enumerate(pairs) if why is not None]
        first: dict[str, int] = {}
        for r, (where, _) in enumerate(pairs):
            if first.setdefault(where, r) != r:
                why = f"{where} is rank {first[where]}'s directory too: with shared=False each "
                problems.append((r, why + "rank saves into its own directory"))
        return by_rank(problems) if problems else None

    def __enter__(self) -> AtomicSave:
        return self

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> None:
        if self._handed_off:
            return
        if error is not None and not isinstance(error, (CheckpointError, OSError)):
            return  # a crash's (a peer gone): the next save removes the temporary
        if error is not None and not self.own:  # DCP's verdict, raised on every rank
            if self.holds:
                atomic_dir.discard(self.tmp)
            return
        failure = str(error) if error is not None else self.commit() if self.holds else None
        if not self.own:  # rank 0's verdict: every rank returns after the commit
            if verdict := comm.broadcast_object(failure, self.group):
                raise CheckpointError(str(verdict))
            return
        failures = comm.all_gather_objects(failure, comm.default_group(self.group))
        if failed := [(r, str(f)) for r, f in enumerate(failures) if f]:
            atomic_dir.discard(self.tmp)
            raise CheckpointError("checkpoint save failed: " + by_rank(failed))

    def commit(self) -> str | None:
        """Swap the written temporary onto the path and remove what earlier saves left beside
        it (the rank that holds it); why it failed, naming both directories, or ``None``."""
        try:
            atomic_dir.commit(self.tmp, self.target)
        except OSError as e:
            return (
                f"the checkpoint was written to {self.tmp} but could not replace {self.target}: {e}"
            )
        atomic_dir.remove_leftovers(self.target)  # of earlier saves killed before their commit
        return None

    def hand_off(self) -> None:
        """Leave the commit and the verdict to the caller (a background save's thread)."""
        self._handed_off = True


def save_pieces(
    path: str | os.PathLike[str],
    pieces: Pieces,
    objects: Mapping[str, object],
    process_group: dist.ProcessGroup | None = None,
    *,
    max_box_numel: int | None = DEFAULT_MAX_BOX_NUMEL,
    shared: bool = True,
) -> None:
    """Write this rank's pieces and ``objects`` to the directory ``path``, atomically; collective.

    Args:
        pieces: What this rank holds (:data:`Pieces`): a whole tensor is ``(0, numel)``; a
            scalar several ranks hold is ``(0, 1)`` on each (written once, the copies checked
            to agree).
        objects: Small picklable values (identical on every rank that passes one).
        max_box_numel: No stored chunk is larger (:data:`DEFAULT_MAX_BOX_NUMEL`).
        shared: ``False``: ``path`` is this rank's own directory (see the module).

    Raises:
        CheckpointError: On every rank, naming each rank's cause (:class:`AtomicSave`).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> save_pieces(path, {"w": ((2,), torch.float32, [(0, 2, torch.ones(2))])}, {"n": 1})
        >>> read_keys(path), read_objects(path, ["n"]), verify(path)
        ({'n': None, 'w': ((2,), torch.float32)}, {'n': 1}, 2)
    """
    with AtomicSave(path, process_group, own=not shared) as save:
        save_id = None if shared else comm.broadcast_object(uuid.uuid4().hex, process_group)
        planner, writer = dcp_parts(save.tmp, pieces, max_box_numel)
        with dcp_errors("save"):
            dcp_save(
                dict(objects), storage_writer=writer, planner=planner, process_group=process_group
            )
        if save_id is not None:
            world = comm.group_size(comm.default_group(process_group))
            write_manifest(save.tmp, str(save_id), comm.rank_or_zero(process_group), world)


def write_manifest(directory: str, save_id: str, rank: int, world_size: int) -> None:
    """Write rank ``rank``'s manifest into ``directory``: the save's id and each file there
    (but manifests and the save marker) with its size and CRC32; flushed to disk."""
    files = {}
    for name in sorted(os.listdir(directory)):
        if name != atomic_dir.MARKER and not _MANIFEST_RE.match(name):
            crc, size = atomic_dir.file_crc(os.path.join(directory, name))
            files[name] = {"size": size, "crc32": f"{crc:08x}"}
    body = {"save": save_id, "rank": rank, "world_size": world_size, "files": files}
    path = os.path.join(directory, f".rank-{rank}-of-{world_size}.json")
    with open(path, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def check_parts(path: str | os.PathLike[str]) -> None:
    """Raise a :class:`CheckpointError` unless the ``shared=False`` checkpoint at ``path`` holds
    every rank's part of one save (every manifest, one save id, each listed file of its size);
    nothing where there are no manifests.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> write_manifest(d, "abc", 0, 2)
        >>> check_parts(d)
        Traceback (most recent call last):
        ...
        zero_functional.checkpoint.storage.CheckpointError: the checkpoint in ... is missing rank 1's part (ranks 0-1 of 2 saved it with shared=False): merge every rank's directory into it
    """
    directory = os.fspath(path)
    if not os.path.isdir(directory):
        return  # the reader names a missing directory
    found: dict[int, tuple[int, dict[str, object]]] = {}
    for name in os.listdir(directory):
        if m := _MANIFEST_RE.match(name):
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
    if missing := [r for r in range(world) if r not in found]:
        many = len(missing) > 1
        whose = f"ranks {first_of(missing)}'s parts" if many else f"rank {missing[0]}'s part"
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


def write_alone(
    directory: str, pieces: Pieces, objects: Mapping[str, object], max_box_numel: int | None
) -> None:
    """Write ``pieces`` and ``objects`` into the new directory ``directory`` as a checkpoint of
    their own, in this process alone: no collective, no commit (the caller renames it into
    place); a thread may call it. The format and checksums are :func:`save_pieces`'.

    Raises:
        CheckpointError: A piece that does not fit, or a file that cannot be written.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "share")
        >>> write_alone(path, {"w": ((2,), torch.float32, [(0, 2, torch.ones(2))])}, {"n": 1}, None)
        >>> read_objects(path, ["n"]), verify(path)
        ({'n': 1}, 2)
    """
    os.makedirs(directory)
    planner, writer = dcp_parts(directory, pieces, max_box_numel)
    planner.set_up_planner(dict(objects), writer.storage_meta(), True)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)  # writes .metadata
    local = writer.prepare_local_plan(planner.create_local_plan())
    central, metadata = planner.create_global_plan([local])
    plan = planner.finish_plan(writer.prepare_global_plan(central)[0])
    writer.finish(metadata, [writer.write_data(plan, planner).value()])


def read_index(path: str | os.PathLike[str]) -> Metadata:
    """The index (DCP's ``Metadata``) of the checkpoint at ``path``, its checksum checked.

    Raises:
        CheckpointError: No checkpoint at ``path``.
        CheckpointCorruptError: The index does not match its checksum.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> write_alone(path, {"w": ((2,), torch.float32, [(0, 2, torch.ones(2))])}, {}, None)
        >>> sorted(read_index(path).state_dict_metadata)
        ['w']
    """
    if (problem := atomic_dir.not_a_checkpoint(os.fspath(path))) is not None:
        raise CheckpointError(problem)  # named for what it is, not "corrupt"
    reader = _ChecksummedReader(os.fspath(path))
    metadata = reader.read_metadata()
    if reader._metadata_error is not None:
        raise reader._metadata_error
    return metadata


def write_index(directory: str, metadata: Metadata) -> None:
    """Write ``metadata`` as the index of ``directory`` with its checksum, as DCP's writer
    does: what reads the files of several checkpoints as one (their indexes merged).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> write_alone(path, {"w": ((2,), torch.float32, [(0, 2, torch.ones(2))])}, {}, None)
        >>> write_index(path, read_index(path)); verify(path)
        1
    """
    path = os.path.join(directory, ".metadata")
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
    _write_index_crc(path)


def verify(path: str | os.PathLike[str]) -> int:
    """Check every stored item's length and checksum, in this process alone (what a launcher
    runs before it starts ranks on a checkpoint); the number of items.

    Raises:
        CheckpointError: No checkpoint at ``path``.
        CheckpointCorruptError: A missing or truncated file, a checksum that does not match.
    """
    metadata = read_index(path)
    for _ in _checked_items(os.fspath(path), metadata.storage_data, metadata.storage_data):
        pass
    return len(metadata.storage_data)


def read_objects(path: str | os.PathLike[str], keys: Sequence[str]) -> dict[str, object]:
    """The objects ``keys`` of a checkpoint, checksums checked, in this process alone.

    Raises:
        CheckpointError: No checkpoint, or a key it lacks or holds as a tensor.
        CheckpointCorruptError: An object's bytes are not what was written.
    """
    metadata = read_index(path)
    for key in keys:
        if not isinstance(metadata.state_dict_metadata.get(key), BytesStorageMetadata):
            raise CheckpointError(f"the checkpoint at {os.fspath(path)} holds no object {key!r}")
    items = _checked_items(os.fspath(path), metadata.storage_data, map(MetadataIndex, keys))
    return {i.fqn: torch.load(io.BytesIO(raw), weights_only=True) for i, raw in items}


def read_keys(path: str | os.PathLike[str]) -> Saved:
    """The keys of a checkpoint: ``(shape, dtype)`` for tensors, ``None`` for objects (local).

    Raises:
        CheckpointError: No checkpoint at ``path``.
        CheckpointCorruptError: Its index does not match its checksum.
    """
    return {
        key: (tuple(meta.size), meta.properties.dtype)
        if isinstance(meta, TensorStorageMetadata)
        else None
        for key, meta in read_index(path).state_dict_metadata.items()
    }


def load_pieces(
    path: str | os.PathLike[str],
    wanted: Wanted,
    objects: Sequence[str] = (),
    process_group: dist.ProcessGroup | None = None,
) -> tuple[dict[str, list[Tensor]], dict[str, object]]:
    """Read the ranges this rank wants, and objects, from the checkpoint at ``path``; collective.

    Returns:
        Per key, one fresh 1-D CPU tensor per wanted range; per object key, its value.

    Raises:
        CheckpointError: A key missing, of another shape or dtype, or not fully saved.
        CheckpointCorruptError: Bytes on disk that are not what was written.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> save_pieces(path, {"w": ((2, 2), torch.float32, [(0, 4, torch.arange(4.0))])}, {})
        >>> load_pieces(path, {"w": ((2, 2), torch.float32, [(1, 3)])})
        ({'w': [tensor([1., 2.])]}, {})
    """
    out: dict[str, list[Tensor]] = {}
    boxes: dict[str, list[tuple[Box, Tensor]]] = {}
    for key, (shape, dtype, ranges) in wanted.items():
        out[key] = [torch.empty(stop - start, dtype=dtype) for start, stop in ranges]
        boxes[key] = [b for (a, z), t in zip(ranges, out[key]) for b in box_views(shape, a, z, t)]
    state: dict[str, Any] = {k: None for k in objects}
    reader, planner = _ChecksummedReader(os.fspath(path)), _BoxLoadPlanner(wanted, boxes, objects)
    with dcp_errors("load"):
        dcp_load(state, storage_reader=reader, planner=planner, process_group=process_group)
    return out, state
