"""Who owns what (pure): the one frozen :class:`Ownership` every mode asks, and its builders.

Per rank, its :class:`~zero_functional.core.partition.Piece` of each parameter it owns (at most
one each, so its state is one dict per parameter, as in ``torch.optim``): whole parameters
(torch's :func:`sorted_greedy_ownership`), :func:`flat_ownership`, or :func:`bucket_ownership`."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, NamedTuple

from zero_functional.core._validate import (
    check_numels,
    check_rank,
    check_world_size,
    first_of,
    prefix_sums,
)
from zero_functional.core.partition import (
    Piece,
    check_tiling,
    ddp_bucket_assignments,
    flat,
    owners,
    sorted_greedy,
    sorted_greedy_groups,
)

PartitionName = Literal["sorted_greedy", "flat"]
PARTITIONS: tuple[PartitionName, ...] = ("sorted_greedy", "flat")
Held = Sequence[tuple[int, Piece]]  # a parameter's (rank, piece), in element order
Building = list[list[tuple[int, Piece]]]  # per parameter, its (rank, piece) pairs so far


def check_partition(partition: object) -> PartitionName:
    """``partition`` if it names a partition, else a ValueError listing the names.

    Example:
        >>> check_partition("even")
        Traceback (most recent call last):
        ...
        ValueError: partition must be one of 'sorted_greedy', 'flat', got 'even'
    """
    if partition not in PARTITIONS:
        names = ", ".join(repr(p) for p in PARTITIONS)
        raise ValueError(f"partition must be one of {names}, got {partition!r}")
    return partition


class Run(NamedTuple):
    """Elements ``[start, stop)`` of a buffer are owned by ``rank``."""

    start: int
    stop: int
    rank: int


class Transfer(NamedTuple):
    """Elements ``[start, stop)`` of parameter ``param`` go from rank ``src`` to rank ``dst``."""

    param: int
    start: int
    stop: int
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class Ownership:
    """``pieces[rank]``: that rank's pieces by ascending parameter; each element owned once.

    Example:
        >>> o = flat_ownership([6, 3], 2)
        >>> o.owned(1)
        (Piece(param=0, start=5, stop=6), Piece(param=1, start=0, stop=3))
        >>> o.holders(0)[1], o.piece(0, 1), o.loads
        ((1, Piece(param=0, start=5, stop=6)), None, (5, 4))
    """

    numels: tuple[int, ...]
    world_size: int
    pieces: tuple[tuple[Piece, ...], ...]
    _holders: tuple[tuple[tuple[int, Piece], ...], ...] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        check_world_size(self.world_size)
        check_numels(self.numels)
        if len(self.pieces) != self.world_size:
            raise ValueError(
                f"an Ownership over {self.world_size} ranks needs {self.world_size} piece lists, "
                f"got {len(self.pieces)}: build it with flat_ownership() or its siblings"
            )
        n = len(self.numels)
        holders: Building = [[] for _ in range(n)]
        for rank, rank_pieces in enumerate(self.pieces):
            last = -1
            for piece in rank_pieces:
                if not 0 <= piece.param < n or piece.param_numel != self.numels[piece.param]:
                    raise ValueError(
                        f"rank {rank} owns {piece} of a parameter of {piece.param_numel} "
                        f"elements, outside the {n} parameters of sizes {first_of(self.numels)}"
                    )
                if piece.param <= last:
                    raise ValueError(
                        f"rank {rank} lists parameter {piece.param} after {last}: a rank owns at "
                        "most one piece of each parameter, in ascending parameter order"
                    )
                last = piece.param
                holders[piece.param].append((rank, piece))
        for k, held in enumerate(holders):
            held.sort(key=lambda rs: rs[1].start)
            check_tiling(k, self.numels[k], held)
        object.__setattr__(self, "_holders", tuple(tuple(h) for h in holders))

    def owned(self, rank: int) -> tuple[Piece, ...]:
        """The pieces ``rank`` owns."""
        check_rank(rank, self.world_size)
        return self.pieces[rank]

    def holders(self, param: int) -> tuple[tuple[int, Piece], ...]:
        """``(rank, piece)`` for each piece of parameter ``param``, in element order."""
        if not 0 <= param < len(self.numels):
            raise ValueError(f"parameter {param} is not one of the {len(self.numels)} parameters")
        return self._holders[param]

    def piece(self, rank: int, param: int) -> Piece | None:
        """The piece of ``param`` that ``rank`` owns, or ``None``."""
        check_rank(rank, self.world_size)
        return next((piece for r, piece in self.holders(param) if r == rank), None)

    def owner(self, param: int) -> int:
        """The one rank that owns all of ``param`` (a ValueError where it is split).

        Example:
            >>> sorted_greedy_ownership([[5, 1, 7]], 2).owner(0)
            1
        """
        held = self.holders(param)
        if len(held) != 1:
            raise ValueError(
                f"parameter {param} is split across ranks {first_of([r for r, _ in held])}; ask "
                "holders() for its pieces (whole-tensor ownership is partition='sorted_greedy')"
            )
        return held[0][0]

    @property
    def is_whole(self) -> bool:
        """Whether every parameter is owned whole by one rank."""
        return all(len(h) == 1 for h in self._holders)

    @property
    def loads(self) -> tuple[int, ...]:
        """Elements each rank owns."""
        return tuple(sum(s.numel for s in rank_pieces) for rank_pieces in self.pieces)

    def owned_slices(self, order: Sequence[int], rank: int) -> tuple[tuple[int, int, int], ...]:
        """``(param, start, stop)`` of ``rank``'s pieces in a buffer holding the parameters
        ``order`` end to end, in buffer order.

        Example:
            >>> flat_ownership([6, 3], 2).owned_slices([1, 0], 1)
            ((1, 0, 3), (0, 8, 9))
        """
        check_rank(rank, self.world_size)
        held = [self.holders(k) for k in order]  # first: names a parameter out of range
        starts = prefix_sums([self.numels[k] for k in order])
        return tuple(
            (k, base + piece.start, base + piece.stop)
            for k, base, pieces in zip(order, starts, held)
            for r, piece in pieces
            if r == rank
        )

    def extended(self, new: Ownership) -> Ownership:
        """This ownership grown to ``new``'s parameters, its own keeping their pieces (what
        ``add_param_group`` reshards from, so that only what changes hands moves).

        Example:
            >>> flat_ownership([4], 2).extended(flat_ownership([4, 4], 2)).owned(1)
            (Piece(param=0, start=2, stop=4), Piece(param=1, start=0, stop=4))
        """
        n = len(self.numels)
        if new.world_size != self.world_size or new.numels[:n] != self.numels:
            raise ValueError(
                f"cannot extend an ownership of {len(self.numels)} parameters of sizes "
                f"{first_of(self.numels)} over {self.world_size} ranks to one of "
                f"{len(new.numels)} of sizes {first_of(new.numels)} over {new.world_size}: pass "
                "one over these parameters and more, at the same world size"
            )
        grown = [
            mine + tuple(s for s in theirs if s.param >= n)
            for mine, theirs in zip(self.pieces, new.pieces)
        ]
        return Ownership(new.numels, self.world_size, tuple(grown))

    def runs(self, order: Sequence[int]) -> tuple[Run, ...]:
        """Who owns which stretch of a buffer holding the parameters ``order`` end to end (a rank's
        adjacent stretches merged): the unit of the collectives.

        Example:
            >>> flat_ownership([6, 3], 2).runs([1, 0])
            (Run(start=0, stop=3, rank=1), Run(start=3, stop=8, rank=0), Run(start=8, stop=9, rank=1))
        """
        out: list[Run] = []
        base = 0
        for k in order:
            for rank, piece in self.holders(k):
                a, b = base + piece.start, base + piece.stop
                if a == b:
                    continue
                if out and out[-1].rank == rank and out[-1].stop == a:
                    out[-1] = Run(out[-1].start, b, rank)
                else:
                    out.append(Run(a, b, rank))
            base += self.numels[k]
        return tuple(out)

    def transfers(self, new: Ownership) -> tuple[Transfer, ...]:
        """Every stretch of every parameter with its owner here and in ``new`` (the same: stays).

        Example:
            >>> sorted_greedy_ownership([[4, 4]], 2).transfers(flat_ownership([4, 4], 2))[1]
            Transfer(param=1, start=0, stop=4, src=1, dst=1)
        """
        if new.numels != self.numels or new.world_size != self.world_size:
            raise ValueError(
                f"cannot move state from an ownership of {len(self.numels)} parameters over "
                f"{self.world_size} ranks to one of {len(new.numels)} over {new.world_size}: "
                "state moves between ownerships of the same parameters and ranks"
            )
        out: list[Transfer] = []
        for k, (here, there) in enumerate(zip(self._holders, new._holders)):
            if self.numels[k] == 0:
                out.append(Transfer(k, 0, 0, here[0][0], there[0][0]))
            for src, a in here:
                for dst, b in there:
                    lo, hi = max(a.start, b.start), min(a.stop, b.stop)
                    if lo < hi:
                        out.append(Transfer(k, lo, hi, src, dst))
        return tuple(out)


def _from_holders(numels: Sequence[int], world_size: int, per_param: Sequence[Held]) -> Ownership:
    per_rank: list[list[Piece]] = [[] for _ in range(world_size)]
    for held in per_param:
        for rank, piece in held:
            per_rank[rank].append(piece)
    return Ownership(tuple(numels), world_size, tuple(tuple(s) for s in per_rank))


def _whole(k: int, numel: int) -> Piece:
    return Piece(k, 0, numel, numel)


def whole_ownership(numels: Sequence[int], owner: Sequence[int], world_size: int) -> Ownership:
    """Whole parameters, parameter ``k`` on rank ``owner[k]``.

    Example:
        >>> whole_ownership([4, 2, 3], [1, 0, 1], 2).owned(1)
        (Piece(param=0, start=0, stop=4), Piece(param=2, start=0, stop=3))
    """
    held = [[(r, _whole(k, n))] for k, (n, r) in enumerate(zip(numels, owner, strict=True))]
    return _from_holders(numels, world_size, held)


def sorted_greedy_ownership(group_numels: Sequence[Sequence[int]], world_size: int) -> Ownership:
    """torch's whole-tensor ownership of the groups' parameters (``sorted_greedy_groups``).

    Example:
        >>> sorted_greedy_ownership([[4, 2], [3]], 2).owned(1)
        (Piece(param=1, start=0, stop=2), Piece(param=2, start=0, stop=3))
    """
    parts = sorted_greedy_groups(group_numels, world_size)
    numels = [n for g in group_numels for n in g]
    owner = [r for g, part in zip(group_numels, parts) for r in owners(part, len(g))]
    return whole_ownership(numels, owner, world_size)


def flat_ownership(
    numels: Sequence[int],
    world_size: int,
    *,
    keys: Sequence[Hashable] | None = None,
    align: int | Mapping[Hashable, int] = 1,
    blocks: Sequence[int] | None = None,
) -> Ownership:
    """The parameters of each of ``keys`` (a (device, dtype) each) split by
    :func:`~zero_functional.core.partition.flat`; a zero-size one goes where its position falls.

    Example:
        >>> flat_ownership([3, 3, 2], 2, keys=["f32", "f64", "f32"]).owned(0)
        (Piece(param=0, start=0, stop=3), Piece(param=1, start=0, stop=2))
    """
    check_world_size(world_size)
    check_numels(numels)
    if keys is None:
        keys = [None] * len(numels)
    if len(keys) != len(numels):
        raise ValueError(
            f"got {len(keys)} keys for {len(numels)} parameters: pass one per parameter"
        )
    groups: dict[Hashable, list[int]] = {}
    for k, key in enumerate(keys):
        groups.setdefault(key, []).append(k)
    per_param: Building = [[] for _ in numels]
    for key, members in groups.items():
        step = align[key] if isinstance(align, Mapping) else align
        sub = [blocks[k] for k in members] if blocks is not None else None
        part = flat([numels[k] for k in members], world_size, align=step, blocks=sub)
        _place(per_param, members, part.pieces)
        starts = prefix_sums([numels[k] for k in members])
        for j, k in enumerate(members):
            if numels[k] == 0:
                at = (r for r, (lo, hi) in enumerate(part.bounds) if lo <= starts[j] < hi)
                per_param[k].append((next(at, world_size - 1), Piece(k, 0, 0, 0)))
    return _from_holders(numels, world_size, per_param)


def _place(per_param: Building, members: Sequence[int], pieces: Sequence[Sequence[Piece]]) -> None:
    for rank, rank_pieces in enumerate(pieces):
        for s in rank_pieces:
            per_param[members[s.param]].append((rank, replace(s, param=members[s.param])))


def bucket_ownership(
    buckets: Sequence[Sequence[int]],
    numels: Sequence[int],
    world_size: int,
    *,
    partition: PartitionName = "sorted_greedy",
    shard_buckets: bool = False,
    pinned: Mapping[int, int] | None = None,
    keys: Sequence[Hashable] | None = None,
    align: int | Mapping[Hashable, int] = 1,
    blocks: Sequence[int] | None = None,
) -> Ownership:
    """Overlap mode's ownership of DDP's ``buckets`` (their global indices): torch's
    ``ddp_bucket_assignments`` (whole buckets where ``shard_buckets`` fails), or with ``"flat"``
    each bucket split as :func:`flat_ownership` (``pinned``: index -> rank, whole); parameters in
    no bucket are split among themselves.

    Example:
        >>> bucket_ownership([[0, 1, 2]], [4, 4, 9], 2, partition="flat", pinned={2: 1}).owned(1)
        (Piece(param=1, start=0, stop=4), Piece(param=2, start=0, stop=9))
    """
    check_partition(partition)
    check_world_size(world_size)
    check_numels(numels)
    seen = [False] * len(numels)
    for b, members in enumerate(buckets):
        for k in members:
            if not 0 <= k < len(numels) or seen[k]:
                raise ValueError(
                    f"bucket {b} lists parameter {k}, which is out of range or in an earlier "
                    "bucket: pass each bucket's parameter indices once"
                )
            seen[k] = True
    pinned = dict(pinned or {})
    for k, rank in pinned.items():
        if not (0 <= k < len(numels) and 0 <= rank < world_size):
            raise ValueError(f"pinned maps parameter {k} to rank {rank}, out of range")
    rest = [k for k in range(len(numels)) if not seen[k]]
    per_param: Building = [[] for _ in numels]
    if partition == "flat":
        for k, rank in pinned.items():
            per_param[k].append((rank, _whole(k, numels[k])))
        for group in [*buckets, rest]:
            members = [k for k in group if k not in pinned]
            ks = [keys[k] for k in members] if keys is not None else None
            bs = [blocks[k] for k in members] if blocks is not None else None
            ns = [numels[k] for k in members]
            sub = flat_ownership(ns, world_size, keys=ks, align=align, blocks=bs)
            _place(per_param, members, sub.pieces)
        return _from_holders(numels, world_size, per_param)
    sizes = [[numels[k] for k in b] for b in buckets]
    try:
        assigned = ddp_bucket_assignments(sizes, world_size, shard_buckets=shard_buckets)
    except ValueError:
        # torch's shard_buckets rule cannot cut some bucket into at most world_size pieces
        # (DDP's first-iteration buckets are often one big bucket); whole buckets always fit.
        assigned = ddp_bucket_assignments(sizes, world_size, shard_buckets=False)
    for a in (a for assignments in assigned for a in assignments):
        for k in buckets[a.bucket][a.offset : a.offset + a.length]:
            per_param[k].append((a.rank, _whole(k, numels[k])))
    for rank, indices in enumerate(sorted_greedy([numels[k] for k in rest], world_size)):
        for i in indices:
            per_param[rest[i]].append((rank, _whole(rest[i], numels[rest[i]])))
    return _from_holders(numels, world_size, per_param)
