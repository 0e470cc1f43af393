"""Replace a directory atomically: write a marked temporary beside it, swap it in, clean up after.

What :func:`zero_functional.checkpoint.storage.save_pieces` does with a checkpoint, in four steps:

1. :func:`refusal`: ``path`` must be absent, an empty directory or a checkpoint (it holds a
   ``.metadata``, or the marker below); a file, a link or a directory of something else is
   refused, untouched.
2. :func:`make_temporary`: ``<path>.tmp-<12 hex digits>``, holding a marker file that names
   ``path``; the checkpoint is written there.
3. :func:`commit`: the temporary is swapped onto ``path`` (Linux
   ``renameat2(RENAME_EXCHANGE)``, else two renames) and the previous one removed: a crash at
   any moment leaves ``path`` either the previous checkpoint or the new one.
4. :func:`remove_leftovers`: what saves killed before their commit left beside ``path`` is
   removed, but only directories with a temporary's name *and* the marker naming ``path``: a
   user's file or directory of a similar name is never touched.

The marker stays in the committed checkpoint (readers ignore files they do not list), so the
previous checkpoint a crash leaves in a temporary is recognised as ours too.

Nothing here imports torch: the module only moves directories (and checksums files).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import re
import shutil
import uuid
import zlib

__all__ = [
    "MARKER",
    "commit",
    "file_crc",
    "make_temporary",
    "not_a_checkpoint",
    "refusal",
    "remove_leftovers",
]

MARKER = ".zero_functional-save"
"""The file in every directory :func:`make_temporary` makes; it names the path saved to."""

_METADATA = ".metadata"  # what every checkpoint directory holds (DCP's index)


def _marker_text(path: str) -> str:
    return f"zero_functional.checkpoint.atomic_dir: a save to {os.path.abspath(path)}\n"


def refusal(path: str) -> str | None:
    """Why a save must not replace ``path``, naming the fix; ``None`` if it may.

    Example:
        >>> import os, tempfile
        >>> root = tempfile.mkdtemp()
        >>> refusal(os.path.join(root, "ckpt")) is None  # nothing there yet
        True
        >>> with open(os.path.join(root, "notes.txt"), "w") as f:
        ...     _ = f.write("mine")
        >>> print(refusal(os.path.join(root, "notes.txt")))  # doctest: +ELLIPSIS
        /.../notes.txt is a file, not a checkpoint directory: a save would move it away; pass another path, or remove the file
    """
    if not os.path.lexists(path):
        return None
    if os.path.islink(path):
        return (
            f"{path} is a symbolic link: a save would replace the link, not what it points to; "
            f"pass the target ({os.path.realpath(path)}) or another path"
        )
    if not os.path.isdir(path):
        return (
            f"{path} is a file, not a checkpoint directory: a save would move it away; pass "
            "another path, or remove the file"
        )
    entries = os.listdir(path)
    if entries and _METADATA not in entries and not _ours(path, path):
        return (
            f"{path} is a directory that holds no checkpoint ({len(entries)} entries, no "
            f"{_METADATA}): a save replaces the whole directory; pass a new or empty directory, "
            "or a checkpoint's"
        )
    return None


def make_temporary(path: str) -> str:
    """Create ``<path>.tmp-<12 hex digits>`` (and missing parents), marked as a save to ``path``.

    Returns:
        The temporary directory's path.

    Example:
        >>> import os, tempfile
        >>> tmp = make_temporary(os.path.join(tempfile.mkdtemp(), "ckpt"))
        >>> os.path.basename(tmp)[:9], os.listdir(tmp)
        ('ckpt.tmp-', ['.zero_functional-save'])
    """
    target = os.path.abspath(path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.tmp-{uuid.uuid4().hex[:12]}"
    os.mkdir(tmp)
    with open(os.path.join(tmp, MARKER), "w") as f:
        f.write(_marker_text(target))
    return tmp


def _ours(directory: str, path: str) -> bool:
    """Whether ``directory`` is a real directory holding the marker of a save to ``path``."""
    if os.path.islink(directory) or not os.path.isdir(directory):
        return False
    try:
        with open(os.path.join(directory, MARKER)) as f:
            return f.read() == _marker_text(path)
    except (OSError, UnicodeDecodeError):
        return False


def remove_leftovers(path: str) -> list[str]:
    """Remove what earlier saves to ``path`` left beside it; the names removed, sorted.

    A leftover is a directory named ``<name>.tmp-<hex>`` (a save killed before its commit, or
    after it with the previous checkpoint not yet removed) or ``<name>.old-<hex>`` (the same
    on a system without an atomic swap) that holds the marker naming ``path``. Anything else
    is left alone, whatever its name. Best effort: what cannot be removed stays.

    Example:
        >>> import os, tempfile
        >>> root = tempfile.mkdtemp()
        >>> ckpt = os.path.join(root, "ckpt")
        >>> _ = make_temporary(ckpt)                         # a save killed mid-write
        >>> os.mkdir(os.path.join(root, "ckpt.tmp-0123456789ab"))  # no marker: not ours
        >>> [name[:9] for name in remove_leftovers(ckpt)], sorted(os.listdir(root))
        (['ckpt.tmp-'], ['ckpt.tmp-0123456789ab'])
    """
    target = os.path.abspath(path)
    parent, name = os.path.split(target)
    pattern = re.compile(re.escape(name) + r"\.(tmp|old)-[0-9a-f]{8,32}")
    removed = []
    try:
        entries = os.listdir(parent)
    except OSError:
        return []
    for entry in entries:
        full = os.path.join(parent, entry)
        if pattern.fullmatch(entry) and _ours(full, target):
            shutil.rmtree(full, ignore_errors=True)
            if not os.path.lexists(full):
                removed.append(entry)
    return sorted(removed)


# ------------------------------------------------------------------------------ the swap

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    return (
        int(renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)) == 0
    )


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: str, path: str) -> None:
    """Put the directory ``tmp`` at ``path`` atomically and remove what was there.

    Raises:
        OSError: ``path`` became something :func:`refusal` refuses since the save began
            (nothing is moved), or a rename failed.

    Example:
        >>> import os, tempfile
        >>> ckpt = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> for _ in range(2):  # the first puts it there, the second replaces it
        ...     commit(make_temporary(ckpt), ckpt)
        >>> os.listdir(os.path.dirname(ckpt)), os.listdir(ckpt)
        (['ckpt'], ['.zero_functional-save'])
    """
    reason = refusal(path)
    if reason is not None:  # it changed under the save: never swap a user's file away
        raise FileExistsError(reason)
    _fsync_dir(tmp)
    if not os.path.lexists(path):
        os.rename(tmp, path)  # readers see no checkpoint, then the whole new one
    else:
        if _exchange(tmp, path):
            old = tmp  # now the previous checkpoint
        else:  # two renames: a crash between them leaves the previous one at <path>.old-*
            old = f"{path}.old-{uuid.uuid4().hex[:8]}"
            os.rename(path, old)
            os.rename(tmp, path)
        with contextlib.suppress(OSError):  # the new one is in place; the next save retries
            shutil.rmtree(old)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def not_a_checkpoint(path: str) -> str | None:
    """Why ``path`` is not a checkpoint to read, named for what it is (missing, a file, an empty
    directory, a directory of something else, a DCP checkpoint written without our checksums);
    ``None`` if it looks like one of ours (its contents are checked as they are read).

    Example:
        >>> import os, tempfile
        >>> root = tempfile.mkdtemp()
        >>> print(not_a_checkpoint(root))  # doctest: +ELLIPSIS
        /... is an empty directory, not a checkpoint
        >>> with open(os.path.join(root, ".metadata"), "wb") as f:
        ...     _ = f.write(b"DCP")
        >>> print(not_a_checkpoint(root))  # doctest: +ELLIPSIS
        /... is a torch.distributed.checkpoint directory that zero_functional did not write (no .metadata.crc32): read it with torch.distributed.checkpoint.load
    """
    if not os.path.lexists(path):
        return f"there is no checkpoint directory at {path}"
    if not os.path.isdir(path):
        return f"{path} is a file, not a checkpoint directory"
    names = set(os.listdir(path))
    if not names:
        return f"{path} is an empty directory, not a checkpoint"
    if _METADATA not in names:
        shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
        return f"{path} holds no checkpoint (no {_METADATA}; it holds {shown})"
    if _METADATA + ".crc32" not in names:
        return (
            f"{path} is a torch.distributed.checkpoint directory that zero_functional did not "
            f"write (no {_METADATA}.crc32): read it with torch.distributed.checkpoint.load"
        )
    return None


def file_crc(path: str) -> tuple[int, int]:
    """A file's CRC32 and size, read 1 MiB at a time: the checkpoint index's checksum, and each
    file of a ``shared=False`` rank's manifest.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile(delete=False) as f:
        ...     _ = f.write(b"abc")
        >>> file_crc(f.name)
        (891568578, 3)
    """
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return crc, size
