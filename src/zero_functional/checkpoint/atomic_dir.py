"""Replace a directory atomically: write a marked temporary beside it, swap it in, clean up after.

:class:`~zero_functional.checkpoint.storage.AtomicSave` runs :func:`refusal`,
:func:`make_temporary`, :func:`commit` and :func:`remove_leftovers`; a crash at any moment leaves
the previous checkpoint or the new one. No torch here.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import os
import re
import shutil
import socket
import uuid
import zlib
from collections.abc import Iterator

MARKER = ".zero_functional-save"
"""The file in every temporary, naming the path saved to; it stays after the commit (unread)."""

_METADATA = ".metadata"  # what every checkpoint directory holds (DCP's index)


def _marker_text(path: str) -> str:
    """The marker's first line; a second names the save (:func:`_who`)."""
    return f"zero_functional.checkpoint.atomic_dir: a save to {os.path.abspath(path)}\n"


class SaveRaceError(FileExistsError):
    """Another save committed the path while this one was writing (two jobs save to one)."""


# this process's temporaries: the locked marker's descriptor, the path's marker at the start
_HELD: dict[str, tuple[int, str | None]] = {}


def _read_marker(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, MARKER)) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _who(marker: str | None) -> str:
    """The save a marker names, for a message."""
    lines = (marker or "").splitlines()
    return lines[1] if len(lines) > 1 else "a save of an earlier version"


def refusal(path: str) -> str | None:
    """Why a save must not replace ``path``, naming the fix; ``None`` if it may.

    Example:
        >>> refusal("/nonexistent/ckpt") is None
        True
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
    """Create ``<path>.tmp-<hex>``, marked as a save to ``path`` and held by this process (no
    other save's cleanup removes it) until :func:`commit`, :func:`discard` or :func:`release`.

    Example:
        >>> import tempfile
        >>> tmp = make_temporary(os.path.join(tempfile.mkdtemp(), "ckpt"))
        >>> os.path.basename(tmp)[:9], os.listdir(tmp)
        ('ckpt.tmp-', ['.zero_functional-save'])
    """
    target = os.path.abspath(path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    save = uuid.uuid4().hex[:12]
    tmp = f"{target}.tmp-{save}"
    before = _read_marker(target) if _ours(target, target) else None
    os.mkdir(tmp)
    fd = os.open(os.path.join(tmp, MARKER), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    # locked before it names the path: a cleaner that recognises it finds it locked
    with contextlib.suppress(OSError):  # no locks on this file system: see _in_use
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    who = f"save {save} by process {os.getpid()} on {socket.gethostname()}"
    os.write(fd, (_marker_text(target) + who + "\n").encode())
    _HELD[tmp] = (fd, before)
    return tmp


def release(tmp: str) -> None:
    """End this process's hold on its temporary ``tmp``: what stays is a leftover.

    Example:
        >>> import tempfile
        >>> ckpt = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> release(make_temporary(ckpt)); [n[:9] for n in remove_leftovers(ckpt)]
        ['ckpt.tmp-']
    """
    if (held := _HELD.pop(tmp, None)) is not None:
        os.close(held[0])  # and with it the lock


def discard(tmp: str) -> None:
    """Remove this process's temporary ``tmp`` (a failed save's) and end its hold on it.

    Example:
        >>> import tempfile
        >>> ckpt = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> discard(make_temporary(ckpt)); os.listdir(os.path.dirname(ckpt))
        []
    """
    shutil.rmtree(tmp, ignore_errors=True)
    release(tmp)


def _ours(directory: str, path: str) -> bool:
    """Whether ``directory`` is a real directory holding the marker of a save to ``path``."""
    if os.path.islink(directory) or not os.path.isdir(directory):
        return False
    return (_read_marker(directory) or "").startswith(_marker_text(path))


def _in_use(directory: str) -> bool:
    """Whether a live process holds the lock on ``directory``'s marker: a save in progress.
    Where the file system has no locks, every temporary counts as in use (never removed)."""
    try:
        fd = os.open(os.path.join(directory, MARKER), os.O_RDWR)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def remove_leftovers(path: str) -> list[str]:
    """Remove what saves to ``path`` killed before or during their commit left beside it (marked
    ``.tmp-*`` and ``.old-*`` directories no live process holds); the names removed, sorted.

    Example:
        >>> import tempfile
        >>> ckpt = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> live = make_temporary(ckpt)  # a save in progress: kept
        >>> remove_leftovers(ckpt), os.path.exists(live)
        ([], True)
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
        if pattern.fullmatch(entry) and _ours(full, target) and not _in_use(full):
            shutil.rmtree(full, ignore_errors=True)
            if not os.path.lexists(full):
                removed.append(entry)
    return sorted(removed)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    fd, name = ctypes.c_int, ctypes.c_char_p
    renameat2.argtypes = [fd, name, fd, name, ctypes.c_uint]
    cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    return int(renameat2(cwd, os.fsencode(a), cwd, os.fsencode(b), exchange)) == 0


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _turn(parent: str) -> Iterator[None]:
    """Commits into ``parent`` one at a time (a ``flock`` on it; none where unsupported)."""
    fd = os.open(parent, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and with it the lock


def commit(tmp: str, path: str) -> None:
    """Put the directory ``tmp`` at ``path`` atomically and remove what was there, or raise
    :class:`SaveRaceError` if another save committed ``path`` since; the hold on ``tmp`` ends.

    Example:
        >>> import tempfile
        >>> ckpt = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> commit(make_temporary(ckpt), ckpt); commit(make_temporary(ckpt), ckpt)  # replaced
        >>> os.listdir(os.path.dirname(ckpt)), os.listdir(ckpt)
        (['ckpt'], ['.zero_functional-save'])
    """
    parent, old = os.path.dirname(os.path.abspath(path)), None
    try:
        _fsync_dir(tmp)
        with _turn(parent):
            reason = refusal(path)
            if reason is not None:  # it changed under the save: never swap a user's file away
                raise FileExistsError(reason)
            now, held = _read_marker(path) if _ours(path, path) else None, _HELD.get(tmp)
            if now is not None and held is not None and now != held[1]:
                raise SaveRaceError(
                    f"another save committed {os.path.abspath(path)} while this one was writing "
                    f"({_who(now)}); the checkpoint there is that save's, complete, and this one "
                    f"({_who(_read_marker(tmp))}) is not committed: two jobs are saving to one "
                    "directory; give each its own"
                )
            if not os.path.lexists(path):
                os.rename(tmp, path)  # readers see no checkpoint, then the whole new one
            elif _exchange(tmp, path):
                old = tmp  # now the previous checkpoint
            else:  # two renames: a crash between them leaves the previous one at <path>.old-*
                old = f"{path}.old-{uuid.uuid4().hex[:8]}"
                os.rename(path, old)
                os.rename(tmp, path)
            _fsync_dir(parent)
    finally:
        release(tmp)
    if old is not None:
        with contextlib.suppress(OSError):  # the new one is in place; the next save retries
            shutil.rmtree(old)


def not_a_checkpoint(path: str) -> str | None:
    """Why ``path`` is not a checkpoint to read, named for what it is; ``None`` if it is ours.

    Example:
        >>> not_a_checkpoint("/nonexistent/ckpt")
        'there is no checkpoint directory at /nonexistent/ckpt'
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
    """A file's CRC32 and size.

    Example:
        >>> file_crc(os.devnull)
        (0, 0)
    """
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return crc, size


def os_error(error: BaseException) -> OSError | None:
    """The :class:`OSError` behind a failed write, ``error`` or one it was raised while handling
    (``torch.save`` on a full disk raises ``unexpected pos``); ``None`` if there is none.

    Example:
        >>> error = RuntimeError("unexpected pos 704 vs 598")
        >>> error.__context__ = OSError(28, "No space left on device")
        >>> print(os_error(error))
        [Errno 28] No space left on device
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None
