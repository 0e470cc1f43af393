"""Atomic directory replacement: what is refused stays as it was; only our leftovers are removed.

Single-process and fast: the collective side (every rank refuses together) is in
``test_checkpoint.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zero_functional.checkpoint import atomic_dir
from zero_functional.checkpoint.atomic_dir import (
    MARKER,
    commit,
    make_temporary,
    refusal,
    release,
    remove_leftovers,
)


def listing(root: Path) -> dict[str, str]:
    """Every path under ``root`` with a file's contents (a directory: ``"/"``, a link: ``"->"``)."""
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        out[key] = "->" if p.is_symlink() else "/" if p.is_dir() else p.read_text()
        if p.name == MARKER:  # its first line names the path; the second, the save
            out[key] = out[key].split("\n")[0] + "\n"
    return out


def a_checkpoint(path: Path, content: str) -> None:
    commit(make_temporary(str(path)), str(path))
    (path / ".metadata").write_text(content)


def test_a_file_a_link_and_a_directory_of_something_else_are_refused_and_left_as_they_were(
    tmp_path: Path,
) -> None:
    (tmp_path / "notes.txt").write_text("my notes")
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "main.py").write_text("print()")
    (tmp_path / "link").symlink_to(tmp_path / "project")
    before = listing(tmp_path)
    reasons = {name: refusal(str(tmp_path / name)) for name in ("notes.txt", "project", "link")}
    assert "is a file, not a checkpoint directory" in str(reasons["notes.txt"]), reasons
    assert "remove the file" in str(reasons["notes.txt"]), reasons
    assert "holds no checkpoint (1 entries, no .metadata)" in str(reasons["project"]), reasons
    assert "is a symbolic link" in str(reasons["link"]), reasons
    for name in reasons:  # the commit checks again: nothing moves
        tmp = make_temporary(str(tmp_path / name))
        with pytest.raises(FileExistsError):
            commit(tmp, str(tmp_path / name))
        assert remove_leftovers(str(tmp_path / name)) == [os.path.basename(tmp)]
    assert listing(tmp_path) == before


def test_nothing_an_empty_directory_and_a_checkpoint_are_replaced(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    a_checkpoint(tmp_path / "ckpt", "old")
    for name in ("absent", "empty", "ckpt"):
        assert refusal(str(tmp_path / name)) is None, name
        a_checkpoint(tmp_path / name, "new")
    assert listing(tmp_path) == {
        **{name: "/" for name in ("absent", "ckpt", "empty")},
        **{f"{name}/.metadata": "new" for name in ("absent", "ckpt", "empty")},
        **{
            f"{name}/{MARKER}": f"zero_functional.checkpoint.atomic_dir: a save to {tmp_path / name}\n"
            for name in ("absent", "ckpt", "empty")
        },
    }


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two renames"])
def test_leftovers_of_killed_saves_are_removed_and_nothing_else_is(
    exchange: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not exchange:
        monkeypatch.setattr(atomic_dir, "_exchange", lambda a, b: False)
    ckpt = tmp_path / "ckpt"
    a_checkpoint(ckpt, "first")
    killed = [make_temporary(str(ckpt)) for _ in range(2)]  # saves killed before their commit
    old = tmp_path / "ckpt.old-0123abcd"  # killed between the two renames: the previous one
    killed_between = make_temporary(str(ckpt))
    for tmp in [*killed, killed_between]:  # a killed process's locks are gone
        release(tmp)
    os.rename(killed_between, old)
    # look-alikes that are not ours: a file, a directory without the marker, one whose marker
    # names another path, a marked directory of another name
    (tmp_path / "ckpt.tmp-0123456789ab").write_text("a user's file")
    (tmp_path / "ckpt.tmp-ba9876543210").mkdir()
    other = Path(make_temporary(str(tmp_path / "other")))
    os.rename(other, tmp_path / "ckpt.tmp-aaaaaaaaaaaa")
    (tmp_path / "ckpt.backup").mkdir()
    (tmp_path / "ckpt.backup" / MARKER).write_text(
        f"zero_functional.checkpoint.atomic_dir: a save to {ckpt}\n"
    )
    kept = {k: v for k, v in listing(tmp_path).items() if not k.startswith("ckpt/")}
    for path in [*killed, str(old)]:
        del kept[os.path.basename(path)], kept[f"{os.path.basename(path)}/{MARKER}"]

    a_checkpoint(ckpt, "second")  # a save that succeeds, then
    assert sorted(remove_leftovers(str(ckpt))) == sorted(
        os.path.basename(p) for p in [*killed, str(old)]
    )
    after = listing(tmp_path)
    assert after["ckpt/.metadata"] == "second"
    assert {k: v for k, v in after.items() if not k.startswith("ckpt/")} == kept
