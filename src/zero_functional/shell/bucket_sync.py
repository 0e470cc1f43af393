"""BucketSync: one bucket's two directions, gradients onto their owners and parameters back.

Megatron-LM's bucket group: ``start_grad``/``finish_grad`` beside ``start_params``/
``finish_params``, over a DDP bucket, a bucket view, or all of ``step()``'s parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.futures import Future

from zero_functional import comm
from zero_functional.core.layout import bucket_layout, piece_view, views
from zero_functional.core.ownership import Ownership
from zero_functional.core.param_table import ParamTable
from zero_functional.core.partition import Piece
from zero_functional.core.plans import (
    BufferPlan,
    Collectives,
    SyncUnit,
    bucket_view_groups,
    buffer_plan,
    sync_plan,
)
from zero_functional.shell.param_window import InFlight, ParamWindow

Mains = Callable[[Iterable[int]], Mapping[int, Tensor]]  # LocalShard.values: flat main copies


def widened(t: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``t``, or a copy in ``dtype`` where that is another one (a reduce dtype).

    Example:
        >>> widened(torch.ones(2, dtype=torch.bfloat16), torch.float32).dtype
        torch.float32
    """
    return t if dtype is None or dtype == t.dtype else t.to(dtype)


def all_reduce_widened(
    flat: Tensor, dtype: torch.dtype | None, group: comm.ProcessGroup
) -> tuple[Future[Tensor], Tensor]:
    """DDP's average of a bucket's ``flat`` buffer in ``dtype``: its future, and the wide average.

    Example:
        >>> bucket = torch.ones(2, dtype=torch.bfloat16)
        >>> fut, wide = all_reduce_widened(bucket, torch.float32, group)
        >>> wide
        tensor([1., 1.])
    """
    wide = widened(flat, dtype).div_(comm.group_size(group))
    return comm.start_all_reduce(wide, group).copy_after(flat, wide).future(flat), wide


def bucket_indices(table: ParamTable, params: Sequence[Tensor]) -> tuple[int, ...]:
    """The global indices of a DDP bucket's ``params`` (an error naming the fix if one is not ours).

    Example:
        >>> a, b = torch.zeros(1), torch.zeros(2)
        >>> bucket_indices(ParamTable.of([{"params": [a, b]}]), [b, a])
        (1, 0)
    """
    try:
        return tuple(table.index(p) for p in params)
    except KeyError as e:
        raise RuntimeError(
            "a DDP gradient bucket holds a parameter this ZeroRedundancyOptimizer does not "
            "manage: build it from ddp.parameters() (or model.parameters())"
        ) from e


@dataclass(frozen=True, slots=True)
class GatherUnit:
    """One launch of a bucket's all-gather: the parameters it writes, and the ranks that send."""

    indices: tuple[int, ...]
    senders: frozenset[int]


class BucketSync:
    """One bucket's gradient reduction and parameter all-gather, each a start/finish pair.

    Args:
        ranks: The ranks gradients are averaged over (DDP's world).
        replicate: Under a device mesh, the group the owned runs are summed across.
        view: Make the parameters views of one buffer, gathered in place.
        mains: Global indices -> this rank's main copies of its pieces (``LocalShard.values``):
            where the wire has a ``gather_codec``, each owner sends main - parameter in it and
            every rank adds the decoded change, so that the parameters stay equal everywhere.

    Example:
        >>> from zero_functional.core.ownership import flat_ownership
        >>> table = ParamTable.of([{"params": [torch.ones(3), torch.ones(2)]}])
        >>> window = ParamWindow(table, lambda name: comm.call(name, group), deferred=False)
        >>> sync = BucketSync((0, 1), table, flat_ownership([3, 2], 1), 0,
        ...                   comm.Wire(group), "allreduce+broadcast", window)
        >>> sync.start_grad(torch.full((5,), 2.0))
        >>> sync.finish_grad()
        tensor([2., 2., 2., 2., 2.])
    """

    def __init__(
        self,
        indices: Sequence[int],
        table: ParamTable,
        ownership: Ownership,
        rank: int,
        wire: comm.Wire,
        collectives: Collectives,
        window: ParamWindow,
        *,
        ranks: int = 1,
        reduce_dtype: torch.dtype | None = None,
        replicate: comm.ProcessGroup | None = None,
        view: bool = False,
        mains: Mains | None = None,
    ) -> None:
        self.indices = tuple(indices)
        self.codec = wire.gather_codec if mains is not None else None
        self.mains = mains
        self.table, self.ownership, self.rank = table, ownership, rank
        self.wire, self.window = wire, window
        self.ranks, self.reduce_dtype, self.replicate = ranks, reduce_dtype, replicate
        self.plan: BufferPlan = buffer_plan(ownership, self.indices, collectives)
        params = [table.params[k] for k in self.indices]
        device = params[0].device if params else torch.device("cpu")
        self.reducer, self.gatherer = wire.choose(self.plan, device)
        self.buffer = self._make_view(params) if view else None
        self._sends = [(k, r, piece) for k in self.indices for r, piece in ownership.holders(k)]
        self._by_owner = _by_owner(self._sends)  # the gather of changes' payloads, per owner
        self.units, self._batches = self._gather_units()
        self._in_flight: list[InFlight] = []
        # the reduction in flight: (what is reduced, the bucket it rounds back into)
        self._grad: tuple[Tensor, Tensor] | None = None
        self._pending = comm.Pending([])
        self._replicas_left = False

    # ------------------------------------------------------------------ gradients

    def start_grad(self, bucket: Tensor) -> None:
        """Start averaging the 1-D gradient ``bucket`` onto the owners of its runs."""
        flat = widened(bucket, self.reduce_dtype).div_(self.ranks)  # as DDP: divide, then sum
        self._grad = (flat, bucket)
        self._pending = self.reducer.start(flat)
        self._replicas_left = self.replicate is not None

    def grad_done(self) -> bool:
        """Whether the reduce onto the owners has completed (never blocks)."""
        return self._pending.done()

    def _across_replicas(self) -> None:
        # issued on the caller's thread, in bucket order on every replica
        if self._replicas_left and self._grad is not None and self.replicate is not None:
            self._replicas_left = False
            self._pending.wait()
            spans = self.plan.spans_of(self.rank)
            self._pending = comm.start_all_reduce_spans(
                self._grad[0], spans, self.replicate, grouped=self.wire.grouped
            )

    def finish_grad(self) -> Tensor:
        """Wait for the whole reduction: the values in the reduce dtype (owned runs averaged)."""
        assert self._grad is not None, "finish_grad() without start_grad()"
        self._across_replicas()
        self._pending.wait()
        return self._grad[0]

    @property
    def widened(self) -> bool:
        """Whether the reduction runs in a copy wider than the bucket (a reduce dtype)."""
        return self._grad is not None and self._grad[0] is not self._grad[1]

    def owned_grads(
        self, flat: Tensor | None = None, used: set[int] | None = None
    ) -> dict[int, Tensor]:
        """Global index -> the reduced gradient of this rank's piece, a view of ``flat``."""
        flat = self._grad[0] if flat is None and self._grad is not None else flat
        assert flat is not None
        return {
            k: flat[lo:hi]
            for k, lo, hi in self.ownership.owned_slices(self.indices, self.rank)
            if used is None or k in used
        }

    def rounded_back(self) -> Tensor:
        """The bucket with the reduced values rounded back into it, after :meth:`finish_grad`."""
        assert self._grad is not None
        flat, bucket = self._grad
        if bucket is not flat:
            bucket.copy_(flat)
        self._let_go()
        return bucket

    def grad_pending(self) -> comm.Pending:
        """What DDP's future waits on when stepping after backward: the reduction, rounded back."""
        assert self._grad is not None
        self._across_replicas()
        pending = self._pending.copy_after(self._grad[1], self._grad[0])
        self._let_go()
        return pending

    def _let_go(self) -> None:
        # DDP's bucket is its own, replaced when DDP rebuilds its buckets: held here past its
        # backward, the first layout's buffers (a model's gradients) would outlive the rebuild
        self._grad, self._pending = None, comm.Pending([])

    # ------------------------------------------------------------------ parameters

    def _make_view(self, params: list[Tensor]) -> Tensor:
        """Make ``params`` views of one buffer, one at a time (each old one freed once copied)."""
        total = sum(p.numel() for p in params)
        chunk = self.plan.chunk
        size = chunk * self.ownership.world_size if chunk is not None else total
        buffer = torch.empty(size, dtype=params[0].dtype, device=params[0].device)
        buffer[total:].zero_()
        layout = bucket_layout([p.numel() for p in params])
        for p, view in zip(params, views(buffer, layout, [p.shape for p in params])):
            view.copy_(p.detach())
            p.data = view
        return buffer

    def _gather_units(self) -> tuple[tuple[GatherUnit, ...], list[tuple[SyncUnit, ...]]]:
        """The all-gather's units, and each one's broadcasts where pieces travel on their own."""
        if self.ownership.world_size == 1:
            return (), []
        if self.buffer is not None or self.plan.chunk is not None or self.codec is not None:
            owners = frozenset(run.rank for run in self.plan.runs)
            return (GatherUnit(self.indices, owners),), []
        params, sends = self.table.params, self._sends
        plan = sync_plan(
            [r for _, r, _ in sends],
            [piece.numel for _, _, piece in sends],
            [self.table.keys[k] for k, _, _ in sends],
            [not piece.is_whole or params[k].is_contiguous() for k, _, piece in sends],
            nccl=self.wire.grouped,
        )
        units = tuple(
            GatherUnit(
                tuple(sends[i][0] for u in batch for i in u.members),
                frozenset(u.owner for u in batch),
            )
            for batch in plan.batches()
        )
        return units, list(plan.batches())

    def start_params(self, unit: GatherUnit | None = None, *, values: bool = False) -> None:
        """Start the all-gather of ``unit`` (default: every unit) from its owners; with
        ``values``, the owners' values as they are, where a ``gather_codec`` sends changes."""
        params = self.table.params
        for j, u in enumerate(self.units):
            if unit is not None and u is not unit:
                continue
            covered = [params[k] for k in u.indices]
            if self.codec is not None and values:  # each owner's pieces packed, exact
                calls = [
                    ([piece_view(params[k], pc) for k, pc in pieces], r, True)
                    for r, pieces in self._by_owner.items()
                ]
                group, grouped = self.wire.gather_group, self.wire.grouped
                pending = comm.start_gather_units(calls, group, grouped=grouped)
            elif self.codec is not None:
                pending = self._start_changes()
            elif self.buffer is not None:
                pending = self.gatherer.start(self.buffer)
            elif self.plan.chunk is not None:  # pack, gather the even shards, unpack
                with torch.no_grad():
                    staging = torch.cat([p.detach().reshape(-1) for p in covered])
                pending = self.gatherer.start(staging)
                pending.finish.append(functools.partial(comm.unflatten_into, staging, covered))
            else:
                pending = self._start_pieces(self._batches[j])
            self._in_flight.append((pending, covered))

    def _start_changes(self) -> comm.Pending:
        """One broadcast per owner of its pieces' changes (main - parameter, encoded); once
        done, every rank (the owner too) adds the decoded changes to the parameters."""
        assert self.codec is not None and self.mains is not None
        codec, params = self.codec, self.table.params
        payloads: list[tuple[Tensor, int, list[tuple[int, Piece]]]] = []
        for r, pieces in self._by_owner.items():
            numel = sum(piece.numel for _, piece in pieces)
            device = params[pieces[0][0]].device
            if r == self.rank:
                mains = self.mains([k for k, _ in pieces])
                with torch.no_grad():
                    change = torch.cat(
                        [
                            mains[k].float()
                            - piece_view(params[k], pc).detach().reshape(-1).float()
                            for k, pc in pieces
                        ]
                    )
                payload = codec.encode(change)
            else:
                payload = torch.empty(codec.nbytes(numel), dtype=torch.uint8, device=device)
            payloads.append((payload, r, pieces))
        calls = [([payload], r, False) for payload, r, _ in payloads]
        pending = comm.start_gather_units(calls, self.wire.gather_group, grouped=self.wire.grouped)
        pending.finish.append(functools.partial(_add_changes, payloads, params, codec))
        return pending

    def _start_pieces(self, batch: tuple[SyncUnit, ...]) -> comm.Pending:
        """One launch of pieces: each unit's in place, or packed."""
        params, sends = self.table.params, self._sends
        calls = [
            ([piece_view(params[sends[i][0]], sends[i][2]) for i in u.members], u.owner, u.packed)
            for u in batch
        ]
        return comm.start_gather_units(calls, self.wire.gather_group, grouped=self.wire.grouped)

    def finish_params(self) -> None:
        """Hand the all-gathers started to the window (waited for now, or when next read)."""
        in_flight, self._in_flight = self._in_flight, []
        if in_flight:
            self.window.defer(in_flight)


def _by_owner(sends: Sequence[tuple[int, int, Piece]]) -> dict[int, list[tuple[int, Piece]]]:
    """Owner -> its pieces among ``sends`` (global index, piece), in rank order."""
    by_owner: dict[int, list[tuple[int, Piece]]] = {}
    for k, r, piece in sends:
        by_owner.setdefault(r, []).append((k, piece))
    return dict(sorted(by_owner.items()))


def _add_changes(
    payloads: Sequence[tuple[Tensor, int, Sequence[tuple[int, Piece]]]],
    params: Sequence[Tensor],
    codec: comm.Codec,
) -> None:
    """Add each owner's decoded changes to its pieces of ``params`` (the same bits everywhere)."""
    with torch.no_grad():
        for payload, _, pieces in payloads:
            change = codec.decode(payload, sum(piece.numel for _, piece in pieces))
            at = 0
            for k, piece in pieces:
                view = piece_view(params[k].detach(), piece)
                view.add_(change[at : at + piece.numel].view_as(view))
                at += piece.numel


@dataclass
class DDPBuckets:
    """The :class:`BucketSync` of each DDP bucket, built once per bucket and ownership."""

    wire: comm.Wire
    collectives: Collectives
    window: ParamWindow
    ranks: int = 1
    reduce_dtype: torch.dtype | None = None
    replicate: comm.ProcessGroup | None = None
    mains: Mains | None = None
    _syncs: dict[tuple[int, ...], BucketSync] = field(default_factory=dict, init=False)
    _ownership: Ownership | None = field(default=None, init=False)

    def get(
        self, indices: tuple[int, ...], table: ParamTable, ownership: Ownership, rank: int
    ) -> BucketSync:
        """The sync of the bucket of parameters ``indices`` under ``ownership``."""
        if ownership is not self._ownership:
            self._syncs, self._ownership = {}, ownership
        sync = self._syncs.get(indices)
        if sync is None:
            sync = self._syncs[indices] = BucketSync(
                indices,
                table,
                ownership,
                rank,
                self.wire,
                self.collectives,
                self.window,
                ranks=self.ranks,
                reduce_dtype=self.reduce_dtype,
                replicate=self.replicate,
                mains=self.mains,
            )
        return sync


def step_syncs(
    table: ParamTable,
    ownership: Ownership,
    rank: int,
    wire: comm.Wire,
    collectives: Collectives,
    window: ParamWindow,
    bucket_view: bool,
    mains: Mains | None = None,
) -> list[BucketSync]:
    """The syncs of ``step()``'s all-gather: one per bucket view, else one over all trainable."""
    window.finish()  # the old views may still be being written
    params = table.params
    trainable = [p.requires_grad for p in params]
    if not bucket_view:
        # separate tensors: their pieces travel on their own, never packed in one staging
        # copy of the whole model (no even shards)
        live = [k for k, t in enumerate(trainable) if t]
        strategy: Collectives = "reduce+broadcast"
        return [BucketSync(live, table, ownership, rank, wire, strategy, window, mains=mains)]
    if ownership.is_whole:
        for p in params:
            if not p.requires_grad and p.data._base is not None:
                p.data = p.data.detach().clone()  # leave a bucket without losing the value
    return [
        BucketSync(
            members, table, ownership, rank, wire, collectives, window, view=True, mains=mains
        )
        for members in bucket_view_groups(ownership, table.keys, trainable)
    ]
