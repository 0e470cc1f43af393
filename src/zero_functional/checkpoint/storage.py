"""Sharded, checksummed, atomic tensor storage on ``torch.distributed.checkpoint`` (DCP).

Two collective calls, independent of the optimizer: :func:`save_pieces` writes what this rank
holds of each global tensor (flat row-major ranges, cut into the contiguous N-d boxes they
cover, written without copies or padding) plus small objects; :func:`load_pieces` reads back the
ranges this rank asks for, whatever ranges were saved, reading only the saved chunks that
overlap them. Underneath:

* two planners (subclasses of DCP's defaults) emit one DCP ``WriteItem`` per box and ask DCP's
  public ``create_read_items_for_chunk_list`` for the reads; every request is checked against
  the checkpoint's metadata (keys, shapes, dtypes, full coverage) before a byte is read;
* a writer records a CRC32 of every item it writes in DCP's own ``.metadata`` (and one of
  ``.metadata`` beside it); the reader checks length and CRC32 before deserialising, so a
  flipped or truncated byte is a :class:`CheckpointCorruptError`, never NaN state;
* the checkpoint is written to ``<path>.tmp-<id>`` and swapped onto ``<path>`` by rank 0 once
  every rank's data is on disk (:mod:`zero_functional.checkpoint.atomic_dir`): a crash mid-save leaves the
  previous checkpoint readable, and the next save removes what it left. A ``<path>`` that is a
  file, a link or a directory of something else is refused before anything is written.

Values several ranks write under one key (a per-parameter scalar such as Adam's ``step``, the
same object on every rank) are written once, after the coordinator has checked the copies
agree. Files are DCP's format: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``
and DCP's stock reader read them unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import math
import os
import zlib
from collections.abc import Iterator, Mapping, Sequence
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

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "DEFAULT_MAX_BOX_NUMEL",
    "Pieces",
    "Wanted",
    "load_pieces",
    "read_keys",
    "read_objects",
    "commit",
    "dcp_parts",
    "save_pieces",
    "temporary",
    "verify",
]

Pieces = Mapping[str, tuple[Sequence[int], torch.dtype, Sequence[tuple[int, int, Tensor]]]]
"""Per key: the global shape, the dtype, and the ``(start, stop, 1-D tensor)`` ranges held."""
Wanted = Mapping[str, tuple[Sequence[int], torch.dtype, Sequence[tuple[int, int]]]]
"""Per key: the global shape, the dtype, and the ``(start, stop)`` ranges to read."""

DEFAULT_MAX_BOX_NUMEL = 1 << 22
"""No stored chunk holds more elements (16 MiB of fp32): what bounds memory while saving (one
chunk at a time) and loading (at most two chunks beyond the output)."""

_CRC_ATTR = "zf_crc32"  # pickled with each _StorageInfo in .metadata; stock readers ignore it


class CheckpointError(RuntimeError, ValueError):
    """A checkpoint could not be saved, loaded or resumed from; the message names the file (or
    each rank's cause, raised on every rank).

    The library's one checkpoint error: :mod:`~zero_functional.checkpoint`,
    :mod:`~zero_functional.checkpoint.format` (the train job's checks too) and this module raise
    it. A ``RuntimeError`` as the
    sharded layer's was, and a ``ValueError`` as the train job's was, so that code catching
    either keeps working.
    """


class CheckpointCorruptError(CheckpointError):
    """The bytes on disk are not what was written (a checksum mismatch, a truncated file)."""


# ------------------------------------------------------------------------------ planners


@dataclasses.dataclass
class _Want:
    shape: torch.Size
    dtype: torch.dtype
    boxes: list[Box]
    views: list[Tensor]  # per box, a view into the fresh 1-D buffer that receives it


def _digest(obj: object) -> str:
    if isinstance(obj, Tensor):  # its bytes: torch.save's archive costs ~1 ms a tensor
        raw = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return f"{obj.dtype}{tuple(obj.shape)}:{zlib.crc32(raw.numpy().tobytes()):08x}"
    buf = io.BytesIO()
    torch.save(obj, buf)
    return f"{zlib.crc32(buf.getbuffer()):08x}:{buf.tell()}"


class _BoxSavePlanner(DefaultSavePlanner):
    """DCP's save planner (objects, deduplication, validation) plus one SHARD item per box.

    Checks run in ``create_local_plan``, inside DCP's exception-safe local step: a bad input on
    one rank becomes an error on every rank instead of a hang.
    """

    def __init__(self, pieces: Pieces, max_box_numel: int | None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._pieces = pieces
        self._cap = max_box_numel
        self._views: dict[MetadataIndex, Tensor] = {}

    def _items(self) -> list[WriteItem]:
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
                for box, first in flat_range_boxes(shape, start, stop, max_numel=self._cap):
                    n = math.prod(box[1])
                    boxes.append((box, local[first - start : first - start + n].view(box[1])))
            for (offsets, sizes), view in boxes:
                index = MetadataIndex(key, offsets)
                if index in self._views:
                    raise CheckpointError(f"{key}: the box at {offsets} is given twice")
                self._views[index] = view
                items.append(
                    WriteItem(
                        index=index,
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                            properties=TensorProperties(dtype=dtype),
                            size=shape,
                        ),
                    )
                )
        return items

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()  # BYTE_IO items for the objects
        boxes = self._items()
        # DCP keeps one of several ranks' copies of a key without looking at them: ship a digest
        # of each, so the coordinator refuses copies that disagree
        digests: dict[str, object] = {k: _digest(v) for k, v in self.state_dict.items()}
        for item in boxes:
            view = self._views[item.index]
            if view.dim() == 0:
                digests[item.index.fqn] = _digest(view.detach().cpu())
        self.plan = dataclasses.replace(plan, items=plan.items + boxes, planner_data=digests)
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

    def __init__(self, wanted: Mapping[str, _Want], objects: Sequence[str]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._wanted = wanted
        self._objects = list(objects)

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        errors: list[str] = []
        missing = [k for k in [*self._objects, *self._wanted] if k not in saved]
        if missing:
            errors.append(f"it has no {first_of(missing)}")
        for k in self._objects:
            if k in saved and not isinstance(saved[k], BytesStorageMetadata):
                errors.append(f"{k!r} is a tensor there, not an object")
        for k, want in self._wanted.items():
            meta = saved.get(k)
            if meta is None:
                continue
            if not isinstance(meta, TensorStorageMetadata):
                errors.append(f"{k!r} is an object there, not a tensor")
            elif meta.size != want.shape or meta.properties.dtype != want.dtype:
                errors.append(
                    f"{k!r} is {tuple(meta.size)} {meta.properties.dtype} there, but "
                    f"{tuple(want.shape)} {want.dtype} here"
                )
        if errors:
            raise CheckpointError("the checkpoint does not fit: " + "; ".join(errors))
        items = list(super().create_local_plan().items)  # the objects' reads
        for k, want in self._wanted.items():
            if not want.boxes:
                continue
            chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in want.boxes]
            meta = cast(TensorStorageMetadata, saved[k])
            reads = create_read_items_for_chunk_list(k, meta, chunks)
            covered = [0] * len(chunks)
            for r in reads:
                assert r.dest_index.index is not None
                covered[r.dest_index.index] += math.prod(r.lengths)
            for (offsets, sizes), got in zip(want.boxes, covered):
                if got != math.prod(sizes):
                    raise CheckpointCorruptError(
                        f"{k!r}: the checkpoint holds {got} of the {math.prod(sizes)} elements "
                        f"at offsets {offsets}: a rank's pieces were not saved"
                    )
            items += reads
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        want = self._wanted.get(index.fqn)
        if want is not None and index.index is not None:
            return want.views[index.index]
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # weights_only: a checkpoint is data, never code (DCP's own default unpickles anything)
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


# ------------------------------------------------------------------------------ files


class _CrcStream(io.RawIOBase):
    """Write-through to a file, keeping the CRC32 and count of what went through."""

    def __init__(self, raw: io.BufferedWriter) -> None:
        super().__init__()
        self.raw, self.crc, self.n = raw, 0, 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.n += view.nbytes
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
        try:
            results = self._write_items(file, name, plan, planner)
        except (OSError, RuntimeError) as e:  # torch.save's zip writer hides an OSError
            raise CheckpointError(f"cannot write {file}: {atomic_dir.os_error(e) or e}") from e
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _write_items(
        self, file: str, name: str, plan: SavePlan, planner: SavePlanner
    ) -> list[WriteResult]:
        results: list[WriteResult] = []
        with open(file, "wb") as f:
            for item in plan.items:
                data = planner.resolve_data(item)
                offset = f.tell()
                stream = _CrcStream(f)
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
                results.append(
                    WriteResult(index=item.index, size_in_bytes=info.length, storage_data=info)
                )
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        path = os.path.join(str(self.path), ".metadata")
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
        except (OSError, ValueError) as e:
            self._metadata_error = CheckpointCorruptError(f"cannot verify {path}: {e}")
        except CheckpointCorruptError as e:
            self._metadata_error = e
        if self._metadata_error is not None:
            return Metadata(state_dict_metadata={}, storage_data={})
        return super().read_metadata(*args, **kwargs)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._metadata_error is not None:
            raise self._metadata_error
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def _bytes(self, f: io.BufferedReader, where: str, info: _StorageInfo) -> bytes:
        f.seek(info.offset)
        raw = f.read(info.length)
        if len(raw) != info.length:
            size = os.fstat(f.fileno()).st_size
            raise CheckpointCorruptError(
                f"{where} needs bytes [{info.offset}, {info.offset + info.length}) but the file "
                f"has {size}: the checkpoint is truncated"
            )
        expected = getattr(info, _CRC_ATTR, None)
        if expected is None:
            raise CheckpointCorruptError(f"{where} has no recorded checksum")
        got = zlib.crc32(raw)
        if got != expected:
            raise CheckpointCorruptError(
                f"{where}, bytes [{info.offset}, {info.offset + info.length}): crc32 {got:08x} but "
                f"{expected:08x} was recorded: the checkpoint is corrupt"
            )
        return raw

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for relative, reqs in per_file.items():
            reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
            path = os.path.join(str(self.path), relative)
            if not os.path.exists(path):
                raise CheckpointCorruptError(f"the checkpoint file {path} is missing")
            with open(path, "rb") as f:
                for index, group in itertools.groupby(reqs, key=lambda r: r.storage_index):
                    info = self.storage_data[index]
                    where = f"{index.fqn} at offsets {tuple(index.offset or ())} in {relative}"
                    raw = self._bytes(f, where, info)
                    requests = list(group)
                    if requests[0].type == LoadItemType.BYTE_IO:
                        for req in requests:
                            planner.load_bytes(req, io.BytesIO(raw))
                        continue
                    stored = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
                    del raw
                    for req in requests:
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


# ------------------------------------------------------------------------------ entry points


def _unwrap(step: str, error: CheckpointException) -> CheckpointError:
    """DCP's CheckpointException (a BaseException) as one error naming each failed rank."""
    failures = sorted(error.failures.items())
    corrupt = any(isinstance(exc, CheckpointCorruptError) for _, (exc, _) in failures)
    kind = CheckpointCorruptError if corrupt else CheckpointError
    return kind(f"checkpoint {step} failed: " + by_rank([(r, str(e)) for r, (e, _) in failures]))


@contextlib.contextmanager
def dcp_errors(step: str) -> Iterator[None]:
    try:
        yield
    except CheckpointException as e:
        raise _unwrap(step, e) from None


def save_pieces(
    path: str | os.PathLike[str],
    pieces: Pieces,
    objects: Mapping[str, object],
    process_group: dist.ProcessGroup | None = None,
    *,
    max_box_numel: int | None = DEFAULT_MAX_BOX_NUMEL,
) -> None:
    """Write this rank's pieces and ``objects`` to the directory ``path``, atomically; collective.

    Args:
        path: The checkpoint directory; replaced as a whole once every rank has written.
        pieces: What this rank holds (:data:`Pieces`): a whole tensor is ``(0, numel)``; a
            per-parameter scalar held by several ranks is the range ``(0, 1)`` on each (written
            once, after checking the copies agree); a zero-size tensor's key is enough on one
            rank.
        objects: Small picklable values (identical on every rank that passes one).
        process_group: The ranks that save together (default: the world).
        max_box_numel: No stored chunk is larger: the memory a save needs beyond the state.

    Raises:
        CheckpointError: On every rank, naming each rank's cause; the previous checkpoint at
            ``path``, if any, is untouched. ``path`` a file, a symbolic link or a directory
            that holds no checkpoint is refused before anything is written.
    """
    target, tmp = temporary(path, process_group)
    planner, writer = dcp_parts(tmp, pieces, max_box_numel)
    try:
        with dcp_errors("save"):
            dcp_save(
                dict(objects), storage_writer=writer, planner=planner, process_group=process_group
            )
    except CheckpointError:
        if comm.rank_or_zero(process_group) == 0:
            atomic_dir.discard(tmp)
        raise
    mine = commit(tmp, target) if comm.rank_or_zero(process_group) == 0 else None
    error = comm.broadcast_object(mine, process_group)  # every rank returns after the commit
    if error:
        raise CheckpointError(str(error))


def temporary(
    path: str | os.PathLike[str], process_group: dist.ProcessGroup | None
) -> tuple[str, str]:
    """The absolute target and the marked temporary a save writes into; collective.

    Group rank 0 decides (:mod:`~zero_functional.checkpoint.atomic_dir`) before anything is
    written; every rank returns the same or raises the same.

    Raises:
        CheckpointError: ``path`` is refused or no temporary can be made beside it.

    Example:
        >>> import os, tempfile
        >>> target, tmp = temporary(os.path.join(tempfile.mkdtemp(), "ckpt"), None)
        >>> os.path.basename(tmp).startswith(os.path.basename(target) + ".tmp-")
        True
    """
    target = os.path.abspath(os.fspath(path))
    tmp, reason = "", None
    if comm.rank_or_zero(process_group) == 0:
        reason = atomic_dir.refusal(target)
        if reason is None:
            try:
                tmp = atomic_dir.make_temporary(target)
            except OSError as e:
                reason = f"cannot create a directory beside {target} ({e}); pass a writable path"
    tmp, reason = cast(
        tuple[str, "str | None"], comm.broadcast_object((tmp, reason), process_group)
    )
    if reason is not None:
        raise CheckpointError(f"checkpoint save refused, nothing written: {reason}")
    return target, tmp


def commit(tmp: str, target: str) -> str | None:
    """Swap the written temporary onto ``target`` and remove earlier saves' leftovers (one
    rank); why it failed, naming both directories, or ``None``.

    Example:
        >>> import os, tempfile
        >>> target, tmp = temporary(os.path.join(tempfile.mkdtemp(), "ckpt"), None)
        >>> commit(tmp, target), os.listdir(target)
        (None, ['.zero_functional-save'])
    """
    try:
        atomic_dir.commit(tmp, target)
    except OSError as e:
        return f"the checkpoint was written to {tmp} but could not replace {target}: {e}"
    atomic_dir.remove_leftovers(target)  # of earlier saves killed before their commit
    return None


def dcp_parts(
    tmp: str, pieces: Pieces, max_box_numel: int | None
) -> tuple[SavePlanner, FileSystemWriter]:
    """:func:`save_pieces`'s DCP planner and writer of ``pieces`` into ``tmp`` (a CRC32 per item).

    Example:
        >>> planner, writer = dcp_parts("ckpt.tmp-0", {}, None)
    """
    writer = _ChecksummedWriter(tmp, sync_files=True, overwrite=False)
    return _BoxSavePlanner(pieces, max_box_numel), writer


def _metadata(path: str | os.PathLike[str]) -> tuple[_ChecksummedReader, Metadata]:
    if (problem := atomic_dir.not_a_checkpoint(os.fspath(path))) is not None:
        raise CheckpointError(problem)  # named for what it is, not "corrupt"
    reader = _ChecksummedReader(os.fspath(path))
    metadata = reader.read_metadata()
    if reader._metadata_error is not None:
        raise reader._metadata_error
    return reader, metadata


def verify(path: str | os.PathLike[str]) -> int:
    """Check every stored item's length and checksum, in this process alone; the item count.

    What a launcher runs before it starts ranks on a checkpoint (it reads every byte once).

    Raises:
        CheckpointError: No checkpoint at ``path``.
        CheckpointCorruptError: A missing or truncated file, a checksum that does not match.
    """
    reader, metadata = _metadata(path)
    by_file: dict[str, list[tuple[MetadataIndex, _StorageInfo]]] = {}
    for index, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index, info))
    for relative, items in by_file.items():
        file = os.path.join(os.fspath(path), relative)
        if not os.path.exists(file):
            raise CheckpointCorruptError(f"the checkpoint file {file} is missing")
        with open(file, "rb") as f:
            for index, info in sorted(items, key=lambda ii: ii[1].offset):
                where = f"{index.fqn} at offsets {tuple(index.offset or ())} in {relative}"
                reader._bytes(f, where, info)
    return len(metadata.storage_data)


def read_objects(path: str | os.PathLike[str], keys: Sequence[str]) -> dict[str, object]:
    """The objects ``keys`` of a checkpoint, checksums checked, in this process alone.

    Raises:
        CheckpointError: No checkpoint, or a key it lacks or holds as a tensor.
        CheckpointCorruptError: An object's bytes are not what was written.
    """
    reader, metadata = _metadata(path)
    out: dict[str, object] = {}
    for key in keys:
        meta = metadata.state_dict_metadata.get(key)
        if not isinstance(meta, BytesStorageMetadata):
            raise CheckpointError(f"the checkpoint at {os.fspath(path)} holds no object {key!r}")
        index = MetadataIndex(key)
        info = metadata.storage_data[index]
        with open(os.path.join(os.fspath(path), info.relative_path), "rb") as f:
            raw = reader._bytes(f, f"{key} in {info.relative_path}", info)
        out[key] = torch.load(io.BytesIO(raw), weights_only=True)
    return out


def read_keys(
    path: str | os.PathLike[str],
) -> dict[str, tuple[tuple[int, ...], torch.dtype] | None]:
    """The keys of a checkpoint: ``(shape, dtype)`` for tensors, ``None`` for objects (local).

    Raises:
        CheckpointError: No checkpoint at ``path``.
        CheckpointCorruptError: Its index does not match its checksum.
    """
    _, metadata = _metadata(path)
    out: dict[str, tuple[tuple[int, ...], torch.dtype] | None] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            out[key] = (tuple(meta.size), meta.properties.dtype)
        else:
            out[key] = None
    return out


def load_pieces(
    path: str | os.PathLike[str],
    wanted: Wanted,
    objects: Sequence[str] = (),
    process_group: dist.ProcessGroup | None = None,
) -> tuple[dict[str, list[Tensor]], dict[str, object]]:
    """Read the ranges this rank wants, and objects, from the checkpoint at ``path``; collective.

    Reads only the saved chunks that overlap the wanted ranges and checks each one's checksum
    before using it. Every check (keys, shapes, dtypes, coverage, checksums) fails on every
    rank, and nothing the caller owns has changed: the values come back in fresh tensors.

    Returns:
        Per key, one fresh 1-D CPU tensor per wanted range; per object key, its value.

    Raises:
        CheckpointError: A key missing, of another shape or dtype, or not fully saved.
        CheckpointCorruptError: Bytes on disk that are not what was written.
    """
    if not os.path.isdir(os.fspath(path)):
        raise CheckpointError(f"there is no checkpoint directory at {os.fspath(path)}")
    out: dict[str, list[Tensor]] = {}
    plan: dict[str, _Want] = {}
    for key, (shape_seq, dtype, ranges) in wanted.items():
        shape = torch.Size(shape_seq)
        buffers, boxes, views = [], [], []
        for start, stop in ranges:
            buffer = torch.empty(stop - start, dtype=dtype)
            buffers.append(buffer)
            for box, first in flat_range_boxes(shape, start, stop):
                n = math.prod(box[1])
                boxes.append(box)
                views.append(buffer[first - start : first - start + n].view(box[1]))
        out[key] = buffers
        plan[key] = _Want(shape, dtype, boxes, views)
    state: dict[str, Any] = {k: None for k in objects}
    with dcp_errors("load"):
        dcp_load(
            state,
            storage_reader=_ChecksummedReader(os.fspath(path)),
            planner=_BoxLoadPlanner(plan, objects),
            process_group=process_group,
        )
    return out, state
