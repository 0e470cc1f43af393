"""Plans: what to send and reshard, per bucket and per owner, computed from an Ownership (pure).

The stateful parts apply these values and :mod:`zero_functional.comm` executes them. A strategy
(:data:`Collectives`) moves reduced gradients to their owners, then updated pieces to every rank:
``"reduce_scatter+all_gather"`` over even shards, ``"reduce+broadcast"`` per owner's stretch (on
gloo, all-to-alls in chunks), both in DDP's bytes; ``"allreduce+broadcast"`` under a user's hook,
in half again as many (pytorch#69591)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

from zero_functional.core._validate import ceil_div, check_world_size
from zero_functional.core.cost import cost_greedy
from zero_functional.core.ownership import (
    Ownership,
    PartitionName,
    Run,
    Transfer,
    bucket_ownership,
    sorted_greedy_ownership,
)
from zero_functional.core.param_table import BufferKey, ParamTable
from zero_functional.core.partition import owners

Collectives = Literal["allreduce+broadcast", "reduce+broadcast", "reduce_scatter+all_gather"]
COLLECTIVES: tuple[Collectives, ...] = get_args(Collectives)
Runs = Sequence[tuple[int, int, int]]  # (start, stop, rank): Ownership.runs or plain tuples
Stretch = tuple[int, int]
RESHARD_WINDOW = 1 << 20  # elements moved per round of a reshard (about a DDP bucket of state)
FLAT_ALIGN_BYTES = 16  # "flat"'s bounds fall on multiples: where kernels and NCCL like a start
COALESCE_BELOW = 1 << 16  # smaller tensors travel packed; larger ones in place, with no copy


def choose_collectives(
    backend: str, world_size: int, hook_is_allreduce: bool = True, *, even: bool = False
) -> Collectives:
    """The strategy for a buffer, from its backend, world, hook and whether its shards are even.

    Example:
        >>> choose_collectives("nccl", 8, even=True), choose_collectives("gloo", 8, even=True)
        ('reduce_scatter+all_gather', 'reduce+broadcast')
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
    """Whether ``collectives`` sends even shards where a buffer's runs are the even split.

    Example:
        >>> takes_even_shards("reduce_scatter+all_gather")
        True
    """
    return collectives == "reduce_scatter+all_gather"


def even_chunk(runs: Runs, total: int, world_size: int) -> int | None:
    """The shard size if ``runs`` are the even split of ``total`` elements, else ``None``.

    Example:
        >>> even_chunk([(0, 4, 0), (4, 7, 1)], 7, 2), even_chunk([(0, 3, 0), (3, 7, 1)], 7, 2)
        (4, None)
    """
    if total == 0 or not runs or runs[0][0] != 0 or runs[0][2] != 0:
        return None
    chunk = runs[0][1]  # rank r's run is [r * chunk, (r + 1) * chunk), in rank order
    even = [
        (r * chunk, min((r + 1) * chunk, total), r) for r in range(world_size) if r * chunk < total
    ]
    return chunk if [tuple(run) for run in runs] == even else None


@dataclass(frozen=True, slots=True)
class BufferPlan:
    """How one buffer travels (:func:`buffer_plan`): who owns which of its ``runs``, and the even
    shard size ``chunk`` where the strategy takes even shards and gets them (:func:`even_chunk`)."""

    collectives: Collectives
    runs: tuple[Run, ...]
    chunk: int | None

    def spans_of(self, rank: int) -> list[tuple[int, int]]:
        """:func:`owned_spans` of ``rank``."""
        return owned_spans(self.runs, rank)


def buffer_plan(ownership: Ownership, order: Sequence[int], collectives: Collectives) -> BufferPlan:
    """The plan of a buffer holding the parameters ``order`` end to end, under ``collectives``.

    Example:
        >>> o = sorted_greedy_ownership([[4, 3]], 2)
        >>> [buffer_plan(o, order, "reduce_scatter+all_gather").chunk for order in ([0, 1], [1, 0])]
        [4, None]
    """
    runs = ownership.runs(order)
    if not takes_even_shards(collectives):
        return BufferPlan(collectives, runs, None)
    total = sum(ownership.numels[k] for k in order)
    return BufferPlan(collectives, runs, even_chunk(runs, total, ownership.world_size))


def bytes_sent(op: str, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends for collective ``op`` over ``nbytes``, under ring algorithms.

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


def bucket_view_groups(
    ownership: Ownership, keys: Sequence[BufferKey], trainable: Sequence[bool]
) -> list[list[int]]:
    """The parameters (global indices) of each bucket view, sorted by (owner, buffer key).

    Example:
        >>> f32 = BufferKey("cpu", "torch.float32")
        >>> bucket_view_groups(sorted_greedy_ownership([[4, 3, 2]], 2), [f32] * 3, [True] * 3)
        [[0], [1, 2]]
    """
    by_key: dict[tuple[int, BufferKey], list[int]] = {}
    whole = ownership.is_whole  # else one view group per key, frozen parameters too
    for k, key in enumerate(keys):
        if trainable[k] or not whole:
            by_key.setdefault((ownership.owner(k) if whole else 0, key), []).append(k)
    groups = [members for _, members in sorted(by_key.items())]
    if whole:
        return groups
    # each owner's whole parameters side by side (Muon's matrices): one run, one broadcast each

    def place(k: int) -> tuple[int, int]:
        holders = ownership.holders(k)
        return (holders[0][0] if len(holders) == 1 else ownership.world_size, k)

    return [sorted(members, key=place) for members in groups]


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    """One rank's part in moving state between ownerships (:func:`plan_moves`): what it
    ``sends`` (to itself too), ``receives`` per parameter in element order, and ``held`` before;
    the ``pairs`` of ranks that exchange anything, alike on every rank."""

    sends: tuple[Transfer, ...]
    receives: dict[int, tuple[Transfer, ...]]
    pairs: tuple[tuple[int, int], ...]
    held: frozenset[int]


def plan_moves(old: Ownership, new: Ownership, rank: int) -> ReshardPlan:
    """What ``rank`` sends, keeps and receives when state moves from ``old`` to ``new``.

    Example:
        >>> from zero_functional.core.ownership import flat_ownership
        >>> plan_moves(sorted_greedy_ownership([[6, 2]], 2), flat_ownership([6, 2], 2), 0).pairs
        ((0, 1),)
    """
    return _reshard_plan(old.transfers(new), rank)


def reshard_rounds(
    old: Ownership, new: Ownership, rank: int, elements: int | None = None
) -> list[ReshardPlan]:
    """:func:`plan_moves` in rounds of whole parameters that move at most ``elements`` elements
    between ranks in all (default :data:`RESHARD_WINDOW`, read when called; a parameter that
    moves more goes alone): the same rounds on every rank, in :func:`balanced_order`, so that a
    reshard holds little more than a round's state twice.

    Example:
        >>> from zero_functional.core.ownership import flat_ownership
        >>> old, new = flat_ownership([8, 8, 8], 2), sorted_greedy_ownership([[8, 8, 8]], 2)
        >>> [sorted(r.receives) for r in reshard_rounds(old, new, 0, elements=4)]  # 4 move, then 8
        [[0], [2]]
    """
    elements = RESHARD_WINDOW if elements is None else elements
    by_param: dict[int, list[Transfer]] = {}
    for t in old.transfers(new):  # each parameter's transfers in element order
        by_param.setdefault(t.param, []).append(t)
    rounds: list[list[Transfer]] = []
    size = elements
    for moves in balanced_order(list(by_param.values())):
        moved = sum(t.stop - t.start for t in moves if t.src != t.dst)
        if size + moved > elements or not rounds:
            rounds.append([])
            size = 0
        rounds[-1] += moves
        size += moved
    return [_reshard_plan(moves, rank) for moves in rounds]


def balanced_order(
    moves: Sequence[Sequence[Transfer]], lookahead: int = 64
) -> list[Sequence[Transfer]]:
    """Parameters' moves in the order a reshard takes them: each, of the next ``lookahead`` in
    parameter order, the one that grows the most grown rank it touches least. In parameter order
    alone, a rank that receives its new pieces before it sends its old ones holds both.

    Example:
        >>> swap = [[Transfer(k, 0, 4, k // 2, 1 - k // 2)] for k in range(4)]  # 0,1 to rank 1
        >>> [m[0].param for m in balanced_order(swap)]  # each rank sends, then receives
        [0, 2, 1, 3]
    """
    growths = [_growth(m) for m in moves]
    left = list(range(len(moves)))
    grown: dict[int, int] = {}  # each rank's state, in elements, over what it held before
    order: list[Sequence[Transfer]] = []

    def worst(k: int) -> int:
        return max((grown.get(r, 0) + d for r, d in growths[k].items()), default=0)

    while left:
        k = left.pop(min(range(min(lookahead, len(left))), key=lambda i: worst(left[i])))
        for r, d in growths[k].items():
            grown[r] = grown.get(r, 0) + d
        order.append(moves[k])
    return order


def _growth(moves: Sequence[Transfer]) -> dict[int, int]:
    """Per rank, the elements of state it gains (received less sent) when ``moves`` are made."""
    out: dict[int, int] = {}
    for t in moves:
        if t.src != t.dst:
            out[t.dst] = out.get(t.dst, 0) + t.stop - t.start
            out[t.src] = out.get(t.src, 0) - (t.stop - t.start)
    return out


def _reshard_plan(moves: Sequence[Transfer], rank: int) -> ReshardPlan:
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


def ownership_for(
    partition: PartitionName, param_groups: Sequence[Mapping[str, Any]], world_size: int
) -> Ownership:
    """:func:`ownership_of` parameter groups (only their tensors' metadata is read).

    Example:
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
    """The ownership ``partition`` gives ``table``'s parameters, ``pinned`` ones whole.

    Example:
        >>> table = ParamTable.of([{"params": [torch.zeros(8), torch.zeros(3, 3)]}])
        >>> ownership_of("flat", table, 2, pinned={1: 0}).owned(0)
        (Piece(param=0, start=0, stop=4), Piece(param=1, start=0, stop=9))
    """
    if partition == "sorted_greedy":
        return sorted_greedy_ownership(table.group_numels(), world_size)
    # no DDP buckets: every parameter but the pinned ones in one flat split per buffer key
    return overlap_ownership([], "flat", table, world_size, pinned=pinned, blocks=blocks)


def overlap_ownership(
    structure: Sequence[Sequence[int]],
    partition: PartitionName,
    table: ParamTable,
    world_size: int,
    shard_buckets: bool = False,
    pinned: Mapping[int, int] | None = None,
    blocks: Sequence[int] | None = None,
) -> Ownership:
    """Overlap mode's ownership of DDP's buckets ``structure``, as :func:`ownership_of`'s.

    Example:
        >>> table = ParamTable.of([{"params": [torch.zeros(10), torch.zeros(3, 3)]}])
        >>> overlap_ownership([[0, 1]], "flat", table, 2, pinned={1: 0}).owned(1)
        (Piece(param=0, start=8, stop=10),)
    """
    align: dict[Hashable, int] = {
        k: max(1, FLAT_ALIGN_BYTES // p.element_size()) for k, p in zip(table.keys, table.params)
    }
    return bucket_ownership(
        structure,
        table.numels,
        world_size,
        partition=partition,
        shard_buckets=shard_buckets,
        pinned=pinned,
        keys=table.keys,
        align=align,
        blocks=blocks,
    )


def whole_owners(
    shapes: Sequence[tuple[int, ...]], world_size: int, costs: Sequence[int] | None = None
) -> list[int]:
    """The rank owning each of ``shapes`` whole: largest ``costs`` (numel) first, least loaded.

    Example:
        >>> whole_owners([(16, 1), (4, 4)], 2, costs=[16, 64])
        [1, 0]
    """
    if costs is None:
        costs = [math.prod(shape) for shape in shapes]
    elif len(costs) != len(shapes):
        raise ValueError(f"{len(costs)} costs for {len(shapes)} tensors: pass one per tensor")
    return list(owners(cost_greedy(costs, world_size), len(shapes)))


def owned_spans(runs: Runs, rank: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` of the runs ``rank`` owns, in buffer order.

    Example:
        >>> owned_spans([(0, 4, 0), (4, 6, 1), (6, 9, 0)], rank=0)
        [(0, 4), (6, 9)]
    """
    return [(a, b) for a, b, owner in runs if owner == rank]


@dataclass(frozen=True, slots=True)
class SyncUnit:
    """One broadcast of a parameter all-gather: ``members`` from ``owner``, in place or ``packed``."""

    owner: int
    members: tuple[int, ...]
    packed: bool


@dataclass(frozen=True, slots=True)
class SyncPlan:
    """A parameter all-gather as broadcasts: the units in issue order, coalesced or not (NCCL).

    Example:
        >>> len(SyncPlan((SyncUnit(0, (0,), False), SyncUnit(1, (1,), False)), False).batches())
        2
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
    """The broadcasts that give every rank every owner's tensors: large contiguous ones in place;
    smaller ones after them, packed per (owner, key); on NCCL, all in one launch.

    Example:
        >>> plan = sync_plan([0, 1, 1], [9, 2, 3], "fff", [True] * 3, nccl=False, coalesce_below=4)
        >>> [(u.owner, u.members, u.packed) for u in plan.units]
        [(0, (0,), False), (1, (1, 2), True)]
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


def exchange_chunks(
    runs: Runs, world_size: int, per_owner: int
) -> tuple[tuple[tuple[Stretch, ...], ...], ...]:
    """``runs`` cut into chunks of at most ``per_owner`` elements per owner, for gloo's
    all-to-alls: per chunk, per rank, the stretches of its runs that chunk carries.

    Example:
        >>> exchange_chunks([(0, 5, 0), (5, 8, 1)], 2, 3)
        ((((0, 3),), ((5, 8),)), (((3, 5),), ()))
    """
    owned: list[list[Stretch]] = [[] for _ in range(world_size)]
    for a, b, rank in runs:
        if b > a:
            owned[rank].append((a, b))
    splits = [sum(b - a for a, b in stretches) for stretches in owned]
    chunks = ceil_div(max(splits, default=0), per_owner)
    out: list[list[list[Stretch]]] = [[[] for _ in range(world_size)] for _ in range(chunks)]
    for rank, stretches in enumerate(owned):
        seen = 0  # elements of this owner's sequence before the stretch
        for a, b in stretches:
            at = a
            while at < b:
                c = (seen + at - a) // per_owner
                stop = min(b, a + (c + 1) * per_owner - seen)
                out[c][rank].append((at, stop))
                at = stop
            seen += b - a
    return tuple(tuple(tuple(part) for part in chunk) for chunk in out)


class ChunkLayout(NamedTuple):
    """One rank's side of one chunk's all-to-all: the elements it ``sends`` and ``receives`` per
    rank, the stretches it sends (``source``; ``span`` where they join up: no copy), and its own."""

    sends: tuple[int, ...]
    receives: tuple[int, ...]
    source: tuple[Stretch, ...]
    span: Stretch | None
    mine: tuple[Stretch, ...]


def chunk_layout(chunk: Sequence[Sequence[Stretch]], rank: int) -> ChunkLayout:
    """What ``rank`` sends, receives and adds in one chunk of :func:`exchange_chunks`.

    Example:
        >>> chunk_layout((((0, 3),), ((5, 8),)), 0)
        ChunkLayout(sends=(0, 3), receives=(0, 3), source=((5, 8),), span=(5, 8), mine=((0, 3),))
    """
    sizes = [sum(b - a for a, b in part) for part in chunk]
    source = tuple(stretch for r, part in enumerate(chunk) if r != rank for stretch in part)
    joined = all(b == c for (_, b), (c, _) in zip(source, source[1:]))
    span = (source[0][0], source[-1][1]) if source and joined else None
    return ChunkLayout(
        sends=tuple(0 if r == rank else n for r, n in enumerate(sizes)),
        receives=tuple(0 if r == rank else sizes[rank] for r in range(len(chunk))),
        source=source,
        span=span,
        mine=tuple(chunk[rank]),
    )
