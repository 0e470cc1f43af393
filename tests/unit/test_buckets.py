"""Examples for zero_functional.core.layout, and parity with torch's DDP bucket assignment."""

from __future__ import annotations

import pytest
import torch

from zero_functional.core.layout import BucketLayout, bucket_layout, flatten, views
from zero_functional.core.partition import BucketAssignment, ddp_bucket_assignments

from tests.torch_reference import torch_bucket_assignments


def _ours(
    bucket_numels: list[list[int]], world_size: int, shard: bool
) -> list[list[tuple[int, int, int, int]]]:
    per_rank = ddp_bucket_assignments(bucket_numels, world_size, shard_buckets=shard)
    return [[(a.bucket, a.rank, a.offset, a.length) for a in r] for r in per_rank]


def test_bucket_layout_aligns_offsets_and_size() -> None:
    layout = bucket_layout([3, 5, 2], align=4)
    assert layout == BucketLayout((3, 5, 2), (0, 4, 12), 16, 4)
    assert bucket_layout([3, 0, 2]).offsets == (0, 3, 3)
    assert bucket_layout([]).size == 0


def test_bucket_layout_validates_itself() -> None:
    with pytest.raises(ValueError, match="overlaps"):
        BucketLayout((3, 3), (0, 2), 6, 1)
    with pytest.raises(ValueError, match="too small"):
        BucketLayout((3,), (0,), 2, 1)
    with pytest.raises(ValueError, match="align must be an int >= 1"):
        bucket_layout([1], align=0)
    with pytest.raises(ValueError, match="tensor.numel"):
        bucket_layout([1, -1])


def test_flatten_views_round_trip_and_share_storage() -> None:
    ts = [torch.arange(6.0).reshape(2, 3), torch.tensor(7.0), torch.ones(1, 2, 2)]
    layout = bucket_layout([t.numel() for t in ts], align=4)
    buffer = flatten(ts, layout)
    assert buffer.shape == (layout.size,)
    assert buffer[6:8].tolist() == [0.0, 0.0]  # padding is zero
    vs = views(buffer, layout, [t.shape for t in ts])
    for v, t in zip(vs, ts):
        assert torch.equal(v, t)
        assert v.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    vs[1].fill_(-1.0)
    assert buffer[layout.offsets[1]].item() == -1.0


def test_flatten_is_pure() -> None:
    t = torch.ones(3, requires_grad=True)
    buffer = flatten([t])
    buffer.add_(1.0)
    assert t.tolist() == [1.0, 1.0, 1.0] and not buffer.requires_grad


def test_flatten_keeps_dtype() -> None:
    assert flatten([torch.zeros(2, dtype=torch.float16)]).dtype == torch.float16


def test_flatten_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="flatten each"):
        flatten([torch.zeros(1), torch.zeros(1, dtype=torch.float64)])
    with pytest.raises(ValueError, match="do not match the layout"):
        flatten([torch.zeros(2)], bucket_layout([3]))
    with pytest.raises(ValueError, match="at least one tensor"):
        flatten([])


def test_views_errors() -> None:
    layout = bucket_layout([4])
    with pytest.raises(ValueError, match="does not hold 4 elements"):
        views(torch.zeros(4), layout, [(3,)])
    with pytest.raises(ValueError, match="contiguous 1-D"):
        views(torch.zeros(2), layout, [(4,)])
    with pytest.raises(ValueError, match="contiguous 1-D"):
        views(torch.zeros(8)[::2], layout, [(4,)])


def test_ddp_bucket_assignments_round_robin() -> None:
    per_rank = ddp_bucket_assignments([[1], [2, 3], [4], [5]], 3)
    assert per_rank == (
        (BucketAssignment(0, 0, 0, 1), BucketAssignment(3, 0, 0, 1)),
        (BucketAssignment(1, 1, 0, 2),),
        (BucketAssignment(2, 2, 0, 1),),
    )


def test_ddp_bucket_assignments_shard_smallest_bucket_first() -> None:
    per_rank = ddp_bucket_assignments([[4, 4], [2]], 2, shard_buckets=True)
    # Bucket 1 (2 elements) goes first, to rank 0; bucket 0 is cut at threshold 5.
    assert per_rank == (
        (BucketAssignment(1, 0, 0, 1), BucketAssignment(0, 0, 1, 1)),
        (BucketAssignment(0, 1, 0, 1),),
    )


BUCKET_CASES = [
    [[4, 4], [2]],
    [[1], [2, 3], [4], [5]],
    [[100, 1, 1, 1], [50, 50], [3], [7, 7, 7]],
    [[768 * 768, 768, 768 * 3072, 3072], [768, 768], [768 * 2304, 2304]],
    [[5, 5], [5, 5], [5, 5]],
]


@pytest.mark.parametrize("bucket_numels", BUCKET_CASES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("shard", [False, True])
def test_ddp_bucket_assignments_equal_torch(
    bucket_numels: list[list[int]], world_size: int, shard: bool
) -> None:
    try:
        expected = torch_bucket_assignments(bucket_numels, world_size, shard)
    except AssertionError:
        with pytest.raises(ValueError, match="more than"):
            ddp_bucket_assignments(bucket_numels, world_size, shard_buckets=shard)
        return
    assert _ours(bucket_numels, world_size, shard) == expected


def test_torch_shard_buckets_fails_when_a_bucket_needs_more_pieces_than_ranks() -> None:
    # Surprising torch behaviour, pinned: four equal parameters in one bucket on two ranks
    # are cut into four pieces (the threshold test is `>=`), and torch then asserts.
    with pytest.raises(AssertionError, match="All indices are disallowed"):
        torch_bucket_assignments([[1, 1, 1, 1]], 2, True)
    with pytest.raises(ValueError, match="shard_buckets=False"):
        ddp_bucket_assignments([[1, 1, 1, 1]], 2, shard_buckets=True)
    assert _ours([[1, 1, 1, 1]], 2, False) == torch_bucket_assignments([[1, 1, 1, 1]], 2, False)


def test_ddp_bucket_assignments_errors() -> None:
    with pytest.raises(ValueError, match="DDP bucket 1 is empty"):
        ddp_bucket_assignments([[1], []], 2)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        ddp_bucket_assignments([[1]], 0)
    with pytest.raises(ValueError, match="length >= 1"):
        BucketAssignment(0, 0, 0, 0)
