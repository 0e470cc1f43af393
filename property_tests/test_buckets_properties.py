"""Properties of zero_functional.core.layout: layouts round-trip, DDP bucket assignment as torch."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from zero_functional.core.layout import bucket_layout, flatten, views
from zero_functional.core.partition import ddp_bucket_assignments

from tests.torch_reference import torch_bucket_assignments

shapes_st = st.lists(st.lists(st.integers(0, 4), max_size=3), min_size=1, max_size=8)
buckets_st = st.lists(st.lists(st.integers(0, 100), min_size=1, max_size=6), max_size=8)


@given(st.lists(st.integers(0, 50), max_size=10), st.integers(1, 16))
def test_bucket_layout_offsets_aligned_disjoint_and_in_size(numels: list[int], align: int) -> None:
    layout = bucket_layout(numels, align=align)
    ends = [o + n for o, n in zip(layout.offsets, numels)]
    assert all(o % align == 0 for o in layout.offsets)
    assert all(e <= o for e, o in zip(ends, layout.offsets[1:]))
    assert layout.size % align == 0 and layout.size >= max(ends, default=0)
    assert layout.size < max(ends, default=0) + align


@given(shapes_st, st.integers(1, 8), st.sampled_from([torch.float32, torch.float64, torch.int64]))
def test_flatten_then_views_round_trips(
    shapes: list[list[int]], align: int, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(len(shapes))
    ts = [(torch.rand(s, generator=g) * 100).to(dtype) for s in shapes]
    copies = [t.clone() for t in ts]
    layout = bucket_layout([t.numel() for t in ts], align=align)
    buffer = flatten(ts, layout)
    out = views(buffer, layout, shapes)
    assert buffer.dtype == dtype and buffer.shape == (layout.size,)
    assert all(torch.equal(o, t) and o.shape == t.shape for o, t in zip(out, ts))
    assert all(torch.equal(t, c) for t, c in zip(ts, copies))  # inputs untouched
    covered = torch.zeros(layout.size, dtype=torch.bool)
    for o, n in zip(layout.offsets, layout.numels):
        covered[o : o + n] = True
    assert not buffer[~covered].any()  # padding is zero


@given(buckets_st, st.integers(1, 6), st.booleans())
def test_ddp_bucket_assignments_cover_every_param_exactly_once(
    buckets: list[list[int]], n: int, shard: bool
) -> None:
    try:
        per_rank = ddp_bucket_assignments(buckets, n, shard_buckets=shard)
    except ValueError:
        assert shard  # only torch's sharding rule can run out of ranks
        return
    seen = [[0] * len(b) for b in buckets]
    for rank, assignments in enumerate(per_rank):
        assert len({a.bucket for a in assignments}) == len(assignments)  # one piece per bucket
        for a in assignments:
            assert a.rank == rank
            for i in range(a.offset, a.offset + a.length):
                seen[a.bucket][i] += 1
    assert all(c == 1 for b in seen for c in b)


@given(buckets_st, st.integers(1, 6), st.booleans())
def test_ddp_bucket_assignments_equal_torch(buckets: list[list[int]], n: int, shard: bool) -> None:
    try:
        expected = torch_bucket_assignments(buckets, n, shard)
    except AssertionError:
        try:
            ddp_bucket_assignments(buckets, n, shard_buckets=shard)
        except ValueError:
            return
        raise AssertionError("torch failed where ours did not") from None
    per_rank = ddp_bucket_assignments(buckets, n, shard_buckets=shard)
    assert [[(a.bucket, a.rank, a.offset, a.length) for a in r] for r in per_rank] == expected
