"""What to send and reshard, per bucket and per owner, computed from an Ownership (pure).

Everything the stateful classes (the optimizer, :mod:`~zero_functional.shell.param_sync`, the hooks)
compute from the ownership, the parameters' metadata and the rank lives here, so that they only
apply plans: the collective strategy (:func:`choose_collectives`, and the one place its name
becomes the even-shards flag: :func:`takes_even_shards`), each buffer's plan as one value
(:class:`BufferPlan`: strategy, runs and even shard, from :func:`buffer_plan`), the parameter
all-gather's send list (:func:`send_list`) and its broadcasts (:class:`SyncPlan`: which units,
in what order, how packed, from :func:`sync_plan`), the groups that bucket views make
(:func:`bucket_view_groups`), and the moves of a reshard (:func:`plan_moves`).
:mod:`~zero_functional.comm` executes these values and calls nothing back.

ZeRO-1 needs two movements per iteration: each rank must receive the reduced gradients of
what it owns (a reduce-scatter), and every rank must receive every owner's updated parameters
(an all-gather). Together they send the bytes of one all-reduce: plain DDP's traffic. Three
ways to do it, chosen by :func:`choose_collectives` from values every rank shares:

* ``"reduce_scatter+all_gather"``: ``reduce_scatter_single`` / ``all_gather_single`` over
  even, padded shards (NCCL's fastest path; needs the flat partition's even split);
* ``"reduce+broadcast"``: one reduce and one broadcast per owner's stretch (uneven shards;
  on NCCL these are grouped into one launch, which is how NCCL builds its own uneven
  reduce-scatter and all-gather; on gloo, whose reduce-scatter is an all-reduce in disguise,
  the fastest measured);
* ``"allreduce+broadcast"``: the user's hook reduces every gradient everywhere (compression
  hooks keep their own reduction), then owners broadcast: 1.5x DDP's bytes (pytorch#69591).

Example:
    >>> choose_collectives("nccl", 8, even=True)
    'reduce_scatter+all_gather'
    >>> choose_collectives("gloo", 8, even=True)
    'reduce+broadcast'
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from zero_functional.core._validate import check_world_size
from zero_functional.core.cost import cost_greedy
from zero_functional.core.ownership import (
    Ownership,
    PartitionName,
    Run,
    Transfer,
    bucket_ownership,
    flat_ownership,
    sorted_greedy_ownership,
)
from zero_functional.core.param_table import BufferKey, ParamTable
from zero_functional.core.partition import Piece, owners

__all__ = [
    "COALESCE_BELOW",
    "COLLECTIVES",
    "BufferPlan",
    "Collectives",
    "FLAT_ALIGN_BYTES",
    "ReshardPlan",
    "SyncPlan",
    "SyncUnit",
    "bucket_view_groups",
    "buffer_plan",
    "buffer_runs",
    "bytes_sent",
    "choose_collectives",
    "choose_param_gather",
    "even_chunk",
    "flat_align",
    "owned_spans",
    "ownership_for",
    "ownership_of",
    "overlap_ownership",
    "plan_moves",
    "send_list",
    "sync_plan",
    "whole_owners",
    "takes_even_shards",
]

Collectives = Literal["allreduce+broadcast", "reduce+broadcast", "reduce_scatter+all_gather"]
COLLECTIVES: tuple[Collectives, ...] = (
    "allreduce+broadcast",
    "reduce+broadcast",
    "reduce_scatter+all_gather",
)


def choose_collectives(
    backend: str, world_size: int, hook_is_allreduce: bool = True, *, even: bool = False
) -> Collectives:
    """The collectives for one buffer of gradients and parameters (a pure policy).

    The rule: a hook other than DDP's default all-reduce keeps its own reduction, and so does
    a single rank (nothing is sent); else even shards on NCCL take NCCL's reduce-scatter and
    all-gather; everything else takes a reduce onto each owner and a broadcast from it: DDP's
    bytes. On gloo the reduce goes out as all-to-alls (:mod:`zero_functional.comm.exchange`):
    on a link shaped to 2 Gbit/s (``benchmarks/bench_collectives.py --link 2gbit``, 32 MB) it
    and the broadcasts each take their byte floor, where gloo's own reduce per owner takes
    1.25-2.3x it and its reduce-scatter 2.0-2.1x.

    Args:
        backend: A ``torch.distributed`` backend name.
        world_size: Ranks in the process group.
        hook_is_allreduce: Whether the DDP hook being replaced is the default all-reduce.
        even: Whether the ownership splits the buffer into even shards (``partition="flat"``).

    Returns:
        The strategy name.

    Raises:
        ValueError: An empty backend name or ``world_size < 1``.

    Example:
        >>> choose_collectives("nccl", 8)
        'reduce+broadcast'
        >>> choose_collectives("nccl", 8, hook_is_allreduce=False, even=True)
        'allreduce+broadcast'
        >>> choose_collectives("gloo", 1)
        'allreduce+broadcast'
    """
    if not backend:
        raise ValueError("backend must be a non-empty backend name such as 'gloo' or 'nccl'")
    check_world_size(world_size)
    if not hook_is_allreduce or world_size == 1:
        return "allreduce+broadcast"
    if even and "nccl" in backend.lower():
        return "reduce_scatter+all_gather"
    return "reduce+broadcast"


def takes_even_shards(collectives: Collectives) -> bool:
    """Whether the strategy ``collectives`` sends even shards through ``reduce_scatter_single``
    and ``all_gather_single`` (where a buffer's runs are the even split): the one place the
    strategy's name becomes that flag.

    Example:
        >>> takes_even_shards("reduce_scatter+all_gather"), takes_even_shards("reduce+broadcast")
        (True, False)
    """
    return collectives == "reduce_scatter+all_gather"


def choose_param_gather(overlap_with_ddp: bool, requested: bool | None = None) -> bool:
    """Whether the parameter all-gather may finish during the next forward: what the user
    ``requested`` (``overlap_param_gather``), and by default never.

    A drop-in keeps torch's observable behaviour at its defaults: parameters are final when
    ``step()`` returns, and in overlap mode when the backward that ran the step returns (torch's
    hook waits for every broadcast at the last bucket). torch's own overlap tests, and user code
    that saves ``model.state_dict()``, reads a tied weight or compares ranks after backward,
    read them then. ``overlap_param_gather=True`` is the opt-in speed (measured in
    ``benchmarks/bench_iteration.py``: 0.88-1.00x instead of 1.06-1.12x torch's best after
    backward at 2-4 ranks on gloo), safe as :mod:`zero_functional.shell.param_sync` describes.

    Example:
        >>> choose_param_gather(overlap_with_ddp=True), choose_param_gather(overlap_with_ddp=False)
        (False, False)
        >>> choose_param_gather(True, requested=True)
        True
    """
    return bool(requested) if requested is not None else False


def even_chunk(runs: Sequence[tuple[int, int, int]], total: int, world_size: int) -> int | None:
    """The shard size if ``runs`` are the even split of ``total`` elements, else ``None``.

    Even means rank ``r`` owns ``[r * chunk, (r + 1) * chunk)`` clipped to ``total`` (ranks
    past the end own nothing): the layout ``reduce_scatter_single`` and ``all_gather_single``
    take, once the buffer is padded to ``chunk * world_size``.

    Args:
        runs: ``(start, stop, rank)`` stretches covering ``[0, total)`` in order.
        total: Elements in the buffer.
        world_size: Ranks.

    Example:
        >>> even_chunk([(0, 4, 0), (4, 7, 1)], 7, 2)
        4
        >>> even_chunk([(0, 3, 0), (3, 7, 1)], 7, 2) is None
        True
    """
    check_world_size(world_size)
    by_rank: dict[int, tuple[int, int]] = {}
    for a, b, rank in runs:
        if rank in by_rank:
            return None
        by_rank[rank] = (a, b)
    first = by_rank.get(0)
    if total == 0 or first is None or first[0] != 0:
        return None
    chunk = first[1]
    expected = {
        r: (r * chunk, min((r + 1) * chunk, total)) for r in range(world_size) if r * chunk < total
    }
    return chunk if by_rank == expected else None


def buffer_runs(
    ownership: Ownership, order: Sequence[int], *, even: bool
) -> tuple[tuple[Run, ...], int | None]:
    """The runs of a buffer holding the parameters ``order`` end to end, and its even shard.

    The one plan of every bucket this package sends (bucket views, DDP buckets in overlap
    mode and under :func:`~zero_functional.hooks.reduce_scatter_hook`): who owns which
    stretch (:meth:`~zero_functional.core.ownership.Ownership.runs`), and the shard size for
    ``reduce_scatter_single`` / ``all_gather_single`` when ``even`` (the strategy takes even
    shards: ``"reduce_scatter+all_gather"``) and the runs are the even split (else ``None``).

    Example:
        >>> from zero_functional.core.ownership import flat_ownership
        >>> o = flat_ownership([4, 3], 2)
        >>> buffer_runs(o, [0, 1], even=True)
        ((Run(start=0, stop=4, rank=0), Run(start=4, stop=7, rank=1)), 4)
        >>> buffer_runs(o, [0, 1], even=False)[1] is None
        True
    """
    runs = ownership.runs(order)
    if not even:
        return runs, None
    total = sum(ownership.numels[k] for k in order)
    return runs, even_chunk(runs, total, ownership.world_size)


@dataclass(frozen=True, slots=True)
class BufferPlan:
    """How one buffer of parameters laid end to end travels: the collective strategy as a value.

    Computed once per buffer and ownership (:func:`buffer_plan`); the gradient reduction
    (:mod:`~zero_functional.shell.grad_sync`) and the parameter all-gather
    (:mod:`~zero_functional.shell.param_sync`) execute it through :mod:`~zero_functional.comm`.

    Attributes:
        collectives: The strategy (:func:`choose_collectives`).
        runs: Who owns which stretch of the buffer, in buffer order, covering it.
        chunk: The even shard size, set iff the strategy takes even shards and the runs are
            the even split: then one ``reduce_scatter_single`` / ``all_gather_single``; else
            one reduce / broadcast per run.
    """

    collectives: Collectives
    runs: tuple[Run, ...]
    chunk: int | None

    def __post_init__(self) -> None:
        if self.chunk is not None and not takes_even_shards(self.collectives):
            raise ValueError(
                f"a chunk ({self.chunk}) is for even shards; {self.collectives!r} takes none: "
                "build the plan with buffer_plan()"
            )

    def spans_of(self, rank: int) -> list[tuple[int, int]]:
        """The ``(start, stop)`` of the runs ``rank`` owns (:func:`owned_spans`).

        Example:
            >>> from zero_functional.core.ownership import flat_ownership
            >>> buffer_plan(flat_ownership([4, 3], 2), [0, 1], "reduce+broadcast").spans_of(1)
            [(4, 7)]
        """
        return owned_spans(self.runs, rank)


def buffer_plan(ownership: Ownership, order: Sequence[int], collectives: Collectives) -> BufferPlan:
    """The plan of a buffer holding the parameters ``order`` end to end, under ``collectives``
    (its runs and even shard: :func:`buffer_runs`); an uneven buffer takes reduces and
    broadcasts under either strategy.

    Example:
        >>> from zero_functional.core.ownership import flat_ownership
        >>> o = flat_ownership([4, 3], 2)
        >>> buffer_plan(o, [0, 1], "reduce_scatter+all_gather").chunk
        4
        >>> buffer_plan(o, [1, 0], "reduce_scatter+all_gather").chunk is None  # not even
        True
    """
    runs, chunk = buffer_runs(ownership, order, even=takes_even_shards(collectives))
    return BufferPlan(collectives, runs, chunk)


def bytes_sent(op: str, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends for one collective over ``nbytes``, under ring algorithms.

    An all-reduce sends ``2 (n - 1) / n`` of the buffer per rank; a reduce-scatter, an
    all-gather, and a reduce or broadcast pipelined along a ring ``(n - 1) / n``. So ZeRO's
    reduce-scatter + all-gather costs exactly one all-reduce: DDP's bytes.

    Args:
        op: ``"all_reduce"``, ``"reduce"``, ``"broadcast"``, ``"reduce_scatter"`` or
            ``"all_gather"``.
        nbytes: Bytes of the whole buffer the collective covers.
        world_size: Ranks.

    Example:
        >>> bytes_sent("all_reduce", 100, 4), bytes_sent("reduce", 100, 4)
        (150.0, 75.0)
    """
    check_world_size(world_size)
    share = (world_size - 1) / world_size * nbytes
    if op == "all_reduce":
        return 2 * share
    if op in ("reduce", "broadcast", "reduce_scatter", "all_gather"):
        return share
    raise ValueError(
        f"unknown collective {op!r}: pass all_reduce, reduce, broadcast, reduce_scatter or "
        "all_gather"
    )


def send_list(ownership: Ownership, trainable: Sequence[bool]) -> list[tuple[int, int, Piece]]:
    """The parameter all-gather without bucket views: each piece of each trainable parameter,
    as ``(global index, owner, piece)``, in index order (the same on every rank).

    Example:
        >>> from zero_functional.core.ownership import flat_ownership
        >>> [(k, r, (s.start, s.stop)) for k, r, s in send_list(flat_ownership([3, 2], 2), [True, False])]
        [(0, 0, (0, 3))]
    """
    return [
        (k, rank, piece)
        for k, live in enumerate(trainable)
        if live
        for rank, piece in ownership.holders(k)
    ]


def bucket_view_groups(
    ownership: Ownership, keys: Sequence[BufferKey], trainable: Sequence[bool]
) -> list[list[int]]:
    """The parameters each bucket view holds (global indices, in order), given each
    parameter's :class:`~zero_functional.core.param_table.BufferKey`.

    Whole-tensor ownerships take torch's buckets: per owner and key, trainable parameters only.
    Split ownerships (``"flat"``) take every parameter of a key, in index order, since a
    parameter's pieces are owned by several ranks. Groups are sorted by (owner, key), the same
    on every rank.

    Example:
        >>> from zero_functional.core.ownership import flat_ownership, sorted_greedy_ownership
        >>> f32 = BufferKey("cpu", "torch.float32")
        >>> bucket_view_groups(sorted_greedy_ownership([[4, 3, 2]], 2), [f32] * 3, [True] * 3)
        [[0], [1, 2]]
        >>> bucket_view_groups(flat_ownership([5, 3], 2), [f32, f32], [True, False])
        [[0, 1]]
    """
    by_key: dict[tuple[int, BufferKey], list[int]] = {}
    for k, key in enumerate(keys):
        if ownership.is_whole:
            if trainable[k]:
                by_key.setdefault((ownership.owner(k), key), []).append(k)
        else:
            by_key.setdefault((0, key), []).append(k)
    return [members for _, members in sorted(by_key.items())]


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    """One rank's part in moving state from one ownership to another.

    Attributes:
        sends: Stretches this rank holds now, with where each goes (``dst`` may be this rank:
            kept, possibly with other bounds).
        receives: Per parameter, the stretches that make up this rank's new pieces, in element
            order (what arrives, or is kept, joined in this order).
        pairs: Every (src, dst) pair of ranks that exchange anything, the same on every rank.
        held: Parameters of which this rank holds a piece now (their state is replaced).
    """

    sends: tuple[Transfer, ...]
    receives: dict[int, tuple[Transfer, ...]]
    pairs: tuple[tuple[int, int], ...]
    held: frozenset[int]


def plan_moves(old: Ownership, new: Ownership, rank: int) -> ReshardPlan:
    """What ``rank`` sends, keeps and receives when state moves from ``old`` to ``new``.

    Raises:
        ValueError: ``new`` is over other parameters or another world size.

    Example:
        >>> from zero_functional.core.ownership import flat_ownership, sorted_greedy_ownership
        >>> plan = plan_moves(sorted_greedy_ownership([[4, 4]], 2), flat_ownership([4, 4], 2), 0)
        >>> plan.pairs, sorted(plan.receives), sorted(plan.held)
        ((), [0], [0])
    """
    moves = old.transfers(new)
    receives: dict[int, list[Transfer]] = {}
    for t in moves:  # in transfer order, which is each parameter's element order
        if t.dst == rank:
            receives.setdefault(t.param, []).append(t)
    return ReshardPlan(
        sends=tuple(t for t in moves if t.src == rank),
        receives={k: tuple(v) for k, v in receives.items()},
        pairs=tuple(sorted({(t.src, t.dst) for t in moves if t.src != t.dst})),
        held=frozenset(t.param for t in moves if t.src == rank),
    )


FLAT_ALIGN_BYTES = 16
"""Under ``partition="flat"`` range bounds fall on multiples of 16 bytes (4 fp32 elements), so
every shard starts where vectorised kernels and NCCL like it."""


def ownership_for(
    partition: PartitionName, param_groups: Sequence[Mapping[str, Any]], world_size: int
) -> Ownership:
    """The ownership ``partition`` gives parameter groups (only their tensors' metadata is
    read): :func:`ownership_of` their :class:`~zero_functional.core.param_table.ParamTable`.

    Example:
        >>> import torch
        >>> groups = [{"params": [torch.zeros(6), torch.zeros(2)]}]
        >>> ownership_for("sorted_greedy", groups, 2).is_whole
        True
    """
    return ownership_of(partition, ParamTable.of(param_groups), world_size)


def ownership_of(
    partition: PartitionName,
    table: ParamTable,
    world_size: int,
    pinned: Mapping[int, int] | None = None,
    blocks: Sequence[int] | None = None,
) -> Ownership:
    """The ownership ``partition`` gives the parameters of ``table``.

    ``"sorted_greedy"`` is torch's whole-tensor assignment; ``"flat"`` splits each (device,
    dtype) group into even ranges whose bounds fall on :data:`FLAT_ALIGN_BYTES`, except the
    parameters ``pinned`` maps to a rank (those of a per-tensor class, with classes per group,
    placed by :func:`whole_owners`): each is owned whole by its rank, as in overlap mode's
    buckets (:func:`overlap_ownership`). A bound inside a parameter whose optimizer quantizes its state
    in ``blocks`` (one per parameter, :func:`~zero_functional.functional.registry.update_block`)
    falls on a block boundary counted from the parameter's start instead
    (:func:`~zero_functional.core.ownership.block_bounds`).

    Example:
        >>> import torch
        >>> table = ParamTable.of([{"params": [torch.zeros(6), torch.zeros(2)]}])
        >>> [(s.param, s.start, s.stop) for s in ownership_of("flat", table, 2).owned(0)]
        [(0, 0, 4)]
        >>> table = ParamTable.of([{"params": [torch.zeros(8), torch.zeros(3, 3)]}])
        >>> ownership_of("flat", table, 2, pinned={1: 0}).owned(0)
        (Piece(param=0, start=0, stop=4), Piece(param=1, start=0, stop=9))
        >>> table = ParamTable.of([{"params": [torch.zeros(1000)]}])
        >>> ownership_of("flat", table, 3, blocks=[256]).owned(1)
        (Piece(param=0, start=512, stop=768),)
    """
    if partition == "sorted_greedy":
        return sorted_greedy_ownership(table.group_numels(), world_size)
    align = flat_align(table)
    numels = list(table.numels)
    if not pinned:
        return flat_ownership(numels, world_size, keys=table.keys, align=align, blocks=blocks)
    split = [k for k in range(len(numels)) if k not in pinned]
    per_rank: list[list[Piece]] = [[] for _ in range(world_size)]
    if split:
        keys = [table.keys[k] for k in split]
        sub_blocks = [blocks[k] for k in split] if blocks is not None else None
        sub = flat_ownership(
            [numels[k] for k in split], world_size, keys=keys, align=align, blocks=sub_blocks
        )
        for rank, pieces in enumerate(sub.pieces):
            per_rank[rank].extend(
                Piece(split[s.param], s.start, s.stop, s.param_numel) for s in pieces
            )
    for k, rank in pinned.items():
        per_rank[rank].append(Piece(k, 0, numels[k], numels[k]))
    ranked = tuple(tuple(sorted(ps, key=lambda s: s.param)) for ps in per_rank)
    return Ownership(tuple(numels), world_size, ranked)


def flat_align(table: ParamTable) -> dict[Hashable, int]:
    """Per buffer key of ``table``, the element count :data:`FLAT_ALIGN_BYTES` holds: where
    ``"flat"``'s range bounds fall, after backward and in overlap mode's buckets alike.

    Example:
        >>> import torch
        >>> table = ParamTable.of([{"params": [torch.zeros(6), torch.zeros(2, dtype=torch.float64)]}])
        >>> sorted(flat_align(table).values())
        [2, 4]
    """
    return {
        k: max(1, FLAT_ALIGN_BYTES // p.element_size()) for k, p in zip(table.keys, table.params)
    }


def overlap_ownership(
    structure: Sequence[Sequence[int]],
    partition: PartitionName,
    table: ParamTable,
    world_size: int,
    shard_buckets: bool = False,
    pinned: Mapping[int, int] | None = None,
    blocks: Sequence[int] | None = None,
) -> Ownership:
    """Overlap mode's ownership of DDP's buckets ``structure`` (per bucket, its parameters'
    global indices in ``table``): :func:`~zero_functional.core.ownership.bucket_ownership`,
    with ``"flat"``'s ranges aligned as after backward (:func:`flat_align`, and on the
    quantization ``blocks`` of each parameter, as :func:`ownership_of`) and the ``pinned``
    tensors (a per-tensor class's, to their ranks) owned whole.

    Example:
        >>> import torch
        >>> table = ParamTable.of([{"params": [torch.zeros(10), torch.zeros(3, 3)]}])
        >>> overlap_ownership([[0, 1]], "flat", table, 2, pinned={1: 0}).owned(1)
        (Piece(param=0, start=8, stop=10),)
    """
    return bucket_ownership(
        structure,
        table.numels,
        world_size,
        partition=partition,
        shard_buckets=shard_buckets,
        pinned=pinned,
        keys=table.keys,
        align=flat_align(table),
        blocks=blocks,
    )


def whole_owners(
    shapes: Sequence[tuple[int, ...]], world_size: int, costs: Sequence[int] | None = None
) -> list[int]:
    """The rank that owns each tensor of ``shapes`` whole under ``"flat"``: the one place that
    balances whole-owned tensors, largest ``costs`` first onto the least loaded rank
    (:func:`~zero_functional.core.cost.cost_greedy`). ``costs`` is each tensor's update cost
    (:func:`~zero_functional.core.cost.update_cost`: Muon's Newton-Schulz ``m*n*min(m, n)``);
    without it, the element count.

    Example:
        >>> whole_owners([(2, 2), (4, 4), (3, 3)], 2)
        [1, 0, 1]
        >>> whole_owners([(16, 1), (4, 4), (2, 2)], 2)  # by size
        [0, 1, 0]
        >>> whole_owners([(16, 1), (4, 4), (2, 2)], 2, costs=[16, 64, 8])  # by Muon's cost
        [1, 0, 1]
    """
    if costs is None:
        costs = [math.prod(shape) for shape in shapes]
    elif len(costs) != len(shapes):
        raise ValueError(f"{len(costs)} costs for {len(shapes)} tensors: pass one per tensor")
    return list(owners(cost_greedy(costs, world_size), len(shapes)))


def owned_spans(runs: Sequence[tuple[int, int, int]], rank: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` of the runs ``rank`` owns, in buffer order: what a shard's owner
    sums across its replicas under a device mesh.

    Example:
        >>> owned_spans([(0, 4, 0), (4, 6, 1), (6, 9, 0)], rank=0)
        [(0, 4), (6, 9)]
    """
    return [(a, b) for a, b, owner in runs if owner == rank]


COALESCE_BELOW = 1 << 16
"""Tensors with fewer elements than this travel in one staging buffer per owner and dtype;
larger contiguous ones are broadcast in place (no copies; gloo runs them concurrently)."""


@dataclass(frozen=True, slots=True)
class SyncUnit:
    """One broadcast of a parameter all-gather: the tensors ``members`` (positions in the
    list of tensors sent) from rank ``owner``, in place (one tensor) or ``packed`` in one
    staging buffer."""

    owner: int
    members: tuple[int, ...]
    packed: bool


@dataclass(frozen=True, slots=True)
class SyncPlan:
    """A parameter all-gather as broadcasts: the units in issue order, and whether they go out
    as one coalesced launch (NCCL) rather than each on its own.

    Example:
        >>> plan = sync_plan([0, 1], [4, 4], ["f32", "f32"], [True, True], nccl=False,
        ...                  coalesce_below=4)
        >>> [u.members for u in plan.units], len(plan.batches())
        ([(0,), (1,)], 2)
    """

    units: tuple[SyncUnit, ...]
    coalesced: bool

    def batches(self) -> tuple[tuple[SyncUnit, ...], ...]:
        """The units as issued: all in one batch when coalesced, else each in its own."""
        return (self.units,) if self.coalesced else tuple((u,) for u in self.units)


def sync_plan(
    owners: Sequence[int],
    numels: Sequence[int],
    keys: Sequence[Hashable],
    contiguous: Sequence[bool],
    *,
    nccl: bool,
    coalesce_below: int = COALESCE_BELOW,
) -> SyncPlan:
    """The broadcasts that give every rank every owner's tensors, from the tensors' metadata.

    Large contiguous tensors travel in place, in list order; smaller ones in one staging buffer
    per (owner, key), after the large ones, sorted by (owner, key); empty ones not at all. On
    NCCL more than one unit goes out as one coalesced launch. Every input is the same on every
    rank, so every rank issues the same broadcasts in the same order.

    Args:
        owners: Each tensor's group rank.
        numels: Each tensor's number of elements.
        keys: Each tensor's buffer key (:class:`~zero_functional.core.param_table.BufferKey`).
        contiguous: Whether each tensor is contiguous (else it is packed).
        nccl: Whether the group's backend is NCCL (which takes grouped broadcasts as one
            launch).
        coalesce_below: Size under which tensors are packed rather than sent alone.

    Raises:
        ValueError: The sequences differ in length.

    Example:
        >>> plan = sync_plan([0, 1, 1], [9, 2, 3], ["f32"] * 3, [True] * 3, nccl=True,
        ...                  coalesce_below=4)
        >>> plan.coalesced, [(u.owner, u.members, u.packed) for u in plan.units]
        (True, [(0, (0,), False), (1, (1, 2), True)])
    """
    if not len(owners) == len(numels) == len(keys) == len(contiguous):
        raise ValueError(f"got {len(numels)} tensors but {len(owners)} owners; pass one per tensor")
    units: list[SyncUnit] = []
    packed: dict[tuple[int, str], list[int]] = {}
    for i, (owner, numel, key, dense) in enumerate(zip(owners, numels, keys, contiguous)):
        if numel >= coalesce_below and dense:
            units.append(SyncUnit(owner, (i,), packed=False))
        elif numel:
            packed.setdefault((owner, str(key)), []).append(i)
    units += [
        SyncUnit(owner, tuple(members), True) for (owner, _), members in sorted(packed.items())
    ]
    return SyncPlan(tuple(units), nccl and len(units) > 1)
