"""Gradient reduction onto the owners: one owner, with a start/finish pair, for every hook.

Megatron-LM's buffers reduce gradients through one ``start_grad_sync`` / ``finish_grad_sync``
pair, whichever of its DDP paths drives them. Here :class:`GradSync` is that owner: both
:func:`~zero_functional.hooks.reduce_scatter_hook` (step after backward) and overlap mode
(:class:`~zero_functional.shell.overlap.OverlapState`) start each DDP bucket's reduction with
:meth:`GradSync.start` and finish it through the :class:`GradReduce` it returns. It holds the
collective strategy (:func:`collectives_for`, the one place it is decided) and each bucket's
:class:`~zero_functional.core.plans.BufferPlan`, cached per ownership.

One reduction, written once: the bucket is widened to the reduce dtype (if any), divided by
DDP's world (as DDP divides, then sums), summed onto the owner of each run in the shard group
(:func:`~zero_functional.comm.start_reduce`), then, under a device mesh, each owner's runs are
summed across its replicas (:func:`~zero_functional.comm.start_all_reduce_spans`), and the
values are rounded back into the bucket once. Every collective is issued from the hook's thread,
in bucket order on every rank (gloo pairs collectives by issue order).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.futures import Future

from zero_functional import comm
from zero_functional.core.ownership import Ownership
from zero_functional.core.param_table import ParamTable
from zero_functional.core.plans import BufferPlan, Collectives, buffer_plan, choose_collectives

if TYPE_CHECKING:
    from zero_functional.optimizer import ZeroRedundancyOptimizer

__all__ = [
    "GradReduce",
    "GradSync",
    "all_reduce_widened",
    "bucket_indices",
    "collectives_for",
    "widened",
]


def collectives_for(
    group: comm.ProcessGroup, *, even: bool, hook_is_allreduce: bool = True
) -> Collectives:
    """The collective strategy for buffers sharded over ``group``: the one place the package
    decides it (:func:`~zero_functional.core.plans.choose_collectives` on the group's backend and
    size). ``even``: the ownership may split buffers evenly.

    Example:
        >>> import torch.distributed as dist
        >>> collectives_for(group, even=True)
        'allreduce+broadcast'
    """
    return choose_collectives(
        comm.backend(group), comm.group_size(group), hook_is_allreduce, even=even
    )


def widened(t: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``t`` itself, or a copy in ``dtype`` where that is another dtype (a reduce dtype).

    Example:
        >>> t = torch.ones(2, dtype=torch.bfloat16)
        >>> widened(t, None) is t, widened(t, torch.float32).dtype
        (True, torch.float32)
    """
    return t if dtype is None or dtype == t.dtype else t.to(dtype)


def all_reduce_widened(
    flat: Tensor, dtype: torch.dtype | None, group: comm.ProcessGroup
) -> tuple[Future[Tensor], Tensor]:
    """DDP's average of a bucket's buffer ``flat`` over ``group``, summed in ``dtype`` and
    rounded back once: what replaces DDP's hook, with a reduce dtype, while the bucket
    structure is not known yet. Returns DDP's future and the average in ``dtype`` (final
    once the future is), which the update reads rather than its rounding.

    Example:
        >>> import torch.distributed as dist
        >>> fut, wide = all_reduce_widened(torch.ones(2, dtype=torch.bfloat16), torch.float32,
        ...                                group)
        >>> fut.wait(), wide.dtype
        (tensor([1., 1.], dtype=torch.bfloat16), torch.float32)
    """
    wide = widened(flat, dtype).div_(comm.group_size(group))
    return comm.start_all_reduce(wide, group).copy_after(flat, wide).future(flat), wide


def bucket_indices(table: ParamTable, params: Sequence[Tensor]) -> tuple[int, ...]:
    """The global indices of a DDP bucket's ``params``, or an error naming the fix.

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


@dataclass(slots=True)
class GradReduce:
    """One bucket's reduction onto its owners, in flight (what :meth:`GradSync.start` gives).

    Attributes:
        pending: The collectives in flight (the reduce; then the sum across replicas).
        flat: What is reduced: the bucket's buffer, or its copy in the reduce dtype.
        out: The bucket's buffer, DDP's result.
        plan: The bucket's plan (its runs, and its even shard if any).
        replicas: The replicate group and this rank's owned spans, until they are summed.
    """

    pending: comm.Pending
    flat: Tensor
    out: Tensor
    plan: BufferPlan
    replicas: tuple[comm.ProcessGroup, list[tuple[int, int]]] | None

    def done(self) -> bool:
        """Whether the reduce onto the owners has completed (never blocks)."""
        return self.pending.done()

    def across_replicas(self) -> None:
        """Under a device mesh: wait for the reduce onto the owners, then start summing this
        rank's runs across its replicas (issued now, on the hook's thread, in bucket order on
        every replica). A no-op without replicas or once done."""
        if self.replicas is not None:
            group, spans = self.replicas
            self.replicas = None
            self.pending.wait()
            self.pending = comm.start_all_reduce_spans(self.flat, spans, group)

    def finish(self) -> Tensor:
        """Wait for the whole reduction (``finish_grad_sync``); the reduced values, in the
        reduce dtype: on this rank, only the runs it owns hold the average."""
        self.across_replicas()
        self.pending.wait()
        return self.flat

    def result(self) -> Tensor:
        """The bucket's buffer holding the reduced values (rounded back from the reduce dtype
        once); after :meth:`finish`."""
        if self.out is not self.flat:
            self.out.copy_(self.flat)
        return self.out

    def owned(self, indices: Sequence[int], ownership: Ownership, rank: int) -> dict[int, Tensor]:
        """The reduced values of the pieces ``rank`` owns in this bucket of the parameters
        ``indices``, in the reduce dtype (views of :attr:`flat`, final once finished)."""
        return {k: self.flat[lo:hi] for k, lo, hi in ownership.owned_slices(indices, rank)}

    def rounded_back(self) -> comm.Pending:
        """Stepping after backward: the collectives to wait for (or to make DDP's future of),
        after which the reduction is done and its values are rounded back into the bucket."""
        self.across_replicas()
        return self.pending.copy_after(self.out, self.flat)


class GradSync:
    """One optimizer's gradient reduction: the strategy, the bucket plans, and their start.

    Args:
        zero: The optimizer whose owners receive the gradients (held weakly).
        collectives: The strategy (:func:`collectives_for`).
        world_group: DDP's group, over which gradients are averaged (under a device mesh the
            shard x replicate ranks).
        reduce_dtype: Reduce in this dtype, or in the bucket's (``None``).
    """

    def __init__(
        self,
        zero: ZeroRedundancyOptimizer,
        collectives: Collectives,
        world_group: comm.ProcessGroup,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        # weakly: the hooks' registries are keyed by `zero`; holding it would keep its
        # groups alive past destroy_process_group (issue 20)
        self._zero = weakref.ref(zero)
        self.collectives: Collectives = collectives
        self.world_group = world_group
        self.ranks = comm.group_size(world_group)
        self.reduce_dtype = reduce_dtype
        self._plans: dict[tuple[int, ...], BufferPlan] = {}
        self._ownership: Ownership | None = None
        self._exchanger: comm.Exchanger | None = None  # gloo's reduce onto owners, on a thread

    @property
    def zero(self) -> ZeroRedundancyOptimizer:
        """The optimizer (held weakly; its hook holds it while DDP runs the hook)."""
        zero = self._zero()
        assert zero is not None, "the ZeroRedundancyOptimizer was garbage-collected"
        return zero

    def indices(self, params: Sequence[Tensor]) -> tuple[int, ...]:
        """The global indices of a bucket's parameters (:func:`bucket_indices`)."""
        return bucket_indices(self.zero.param_table, params)

    def plan(self, indices: tuple[int, ...]) -> BufferPlan:
        """The plan of the bucket of parameters ``indices`` under the optimizer's ownership now
        (computed once per bucket and ownership)."""
        ownership = self.zero.ownership
        if ownership is not self._ownership:
            self._plans, self._ownership = {}, ownership
        plan = self._plans.get(indices)
        if plan is None:
            plan = self._plans[indices] = buffer_plan(ownership, indices, self.collectives)
        return plan

    def start(self, out: Tensor, indices: tuple[int, ...]) -> GradReduce:
        """Start averaging the bucket buffer ``out`` (of the parameters ``indices``) onto the
        owners of its runs (``start_grad_sync``); finish it through the result."""
        zero, plan = self.zero, self.plan(indices)
        flat = widened(out, self.reduce_dtype).div_(self.ranks)  # as DDP's: divide, then sum
        group = zero.process_group
        if plan.chunk is None and self._exchanger is None and comm.exchanges(group, flat):
            # made at the first bucket (a collective: every rank reaches it there)
            self._exchanger = comm.Exchanger(group)
        pending = comm.start_reduce(
            flat, plan.runs, group, chunk=plan.chunk, exchanger=self._exchanger
        )
        replicate = zero.replicate_group
        replicas = (replicate, plan.spans_of(zero.rank)) if replicate is not None else None
        return GradReduce(pending, flat, out, plan, replicas)
