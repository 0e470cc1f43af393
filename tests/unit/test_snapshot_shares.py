"""The pure parts of in-memory snapshots (``checkpoint/shares.py``): who keeps whose copy, which
snapshot is complete, and the merged index of several shares."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from zero_functional.checkpoint import shares, storage
from zero_functional.checkpoint.storage import CheckpointError

from tests.helpers import flip_byte


@given(st.lists(st.integers(0, 3), min_size=2, max_size=12))
def test_every_copy_is_kept_by_another_rank_on_another_node_where_there_is_one(
    nodes: list[int],
) -> None:
    partner = shares.partners(nodes)
    many = len(set(nodes)) > 1
    for rank, p in enumerate(partner):
        assert p is not None and p != rank
        assert (nodes[p] != nodes[rank]) == many  # on another node whenever one exists
    sizes = {n: nodes.count(n) for n in nodes}
    if len(set(sizes.values())) == 1:  # nodes of one size: every rank keeps exactly one copy
        assert sorted(partner) == list(range(len(nodes)))  # type: ignore[type-var]


def test_the_newest_complete_snapshot_across_nodes() -> None:
    a = {(30, 2): {0: "x"}, (20, 2): {0: "x", 1: "y"}}
    b = {(30, 2): {0: "x"}, (10, 1): {0: "z"}}
    assert shares.newest_complete([a, b], None) == (20, 2)  # 30 lacks rank 1's share
    assert shares.newest_complete([a, b], 21) is None
    assert shares.newest_complete([b], None) == (10, 1)
    assert shares.newest_complete([], None) is None


def _share(
    root: Path, rank: int, world: int, values: dict[str, torch.Tensor], extra: object
) -> str:
    path = str(root / shares.share_name(rank, world))
    pieces = {k: ((4,), v.dtype, [(2 * rank, 2 * rank + 2, v)]) for k, v in values.items()}
    storage.write_alone(path, pieces, {"extra": extra}, None)
    shares.seal(path, rank, world)
    return path


def test_merged_shares_read_as_one_checkpoint_and_disagreements_are_refused(
    tmp_path: Path,
) -> None:
    one = _share(tmp_path, 0, 2, {"w": torch.tensor([1.0, 2.0])}, {"e": 1})
    two = _share(tmp_path, 1, 2, {"w": torch.tensor([3.0, 4.0])}, {"e": 1})
    assert shares.check_share(one) is None
    view = str(tmp_path / "view")
    shares.assemble(view, {0: one, 1: two})
    got, objects = storage.load_pieces(view, {"w": ((4,), torch.float32, [(1, 4)])}, ["extra"])
    assert got["w"][0].tolist() == [2.0, 3.0, 4.0] and objects["extra"] == {"e": 1}
    odd = _share(tmp_path / "other", 1, 2, {"w": torch.tensor([3.0, 4.0])}, {"e": 2})
    with pytest.raises(CheckpointError, match="disagree on 'extra'"):
        shares.assemble(str(tmp_path / "view2"), {0: one, 1: odd})
    flip_byte(one, 60)
    data = next(f for f in os.listdir(one) if f.endswith(".distcp"))
    assert "is corrupt" in str(shares.check_share(one)) and one in str(shares.check_share(one))
    with open(os.path.join(one, data), "ab") as f:
        f.write(b"x")
    assert "not" in str(shares.check_share(one))  # its size
