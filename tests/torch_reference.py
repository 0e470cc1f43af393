"""torch's own partition and bucket-assignment code, run on stand-in objects: the parity oracle.

Shared by tests/ and property_tests/ so that both compare against the same call into torch.
"""

from __future__ import annotations

import types

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.optim.zero_redundancy_optimizer import _OverlapInfo, _OverlapStatus


def torch_partition(group_numels: list[list[int]], world_size: int) -> list[list[list[int]]]:
    """torch's real `_partition_parameters` on stand-in tensors: result[group][rank] = indices.

    The method only reads `param_groups`, `world_size`, `_partition_parameters_cache` and two
    helper methods from `self`, so a namespace with those, bound to torch's functions, runs it
    without a process group.
    """
    groups = [{"params": [torch.empty(n) for n in g]} for g in group_numels]
    obj = types.SimpleNamespace(
        param_groups=groups, world_size=world_size, _partition_parameters_cache=[]
    )
    for name in ("_get_min_index", "_partition_param_group"):
        setattr(obj, name, types.MethodType(getattr(ZeroRedundancyOptimizer, name), obj))
    per_rank = ZeroRedundancyOptimizer._partition_parameters(obj)  # type: ignore[arg-type]
    index = [{id(p): i for i, p in enumerate(g["params"])} for g in groups]
    return [
        [[index[g][id(p)] for p in per_rank[r][g]["params"]] for r in range(world_size)]
        for g in range(len(groups))
    ]


def torch_bucket_assignments(
    bucket_numels: list[list[int]], world_size: int, shard_buckets: bool
) -> list[list[tuple[int, int, int, int]]]:
    """torch's real `_bucket_assignments_per_rank` as (bucket, rank, offset, length) per rank.

    The property reads only `_overlap_info`, `world_size`, `global_rank`, its cache and three
    helper methods, so a namespace bound to torch's own methods runs it without DDP.
    """
    info = _OverlapInfo(world_size)
    info.status = _OverlapStatus.INITIALIZED
    info.shard_buckets = shard_buckets
    info.params_per_bucket = [[torch.empty(n) for n in b] for b in bucket_numels]
    info.total_size = sum(map(sum, bucket_numels)) if shard_buckets else None
    obj = types.SimpleNamespace(
        _overlap_info=info,
        world_size=world_size,
        global_rank=0,
        _overlap_with_ddp=True,
        _bucket_assignments_per_rank_cache=[],
    )
    for name in ("_get_min_index", "_get_assigned_rank", "_assign_bucket_subset_to_rank"):
        setattr(obj, name, types.MethodType(getattr(ZeroRedundancyOptimizer, name), obj))
    per_rank = ZeroRedundancyOptimizer._bucket_assignments_per_rank.fget(obj)  # type: ignore[attr-defined]
    return [
        [(a.bucket_index, rank, a.offset, len(a.parameters)) for a in d.values()]
        for rank, d in enumerate(per_rank)
    ]
