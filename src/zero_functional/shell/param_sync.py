"""ParamSync: parameter storage (bucket views) and the parameter all-gather, now or deferred.

The one owner of the parameters' storage and of the all-gathers in flight: it makes bucket
views (``parameters_as_bucket_view``), starts the all-gather of the owners' updated pieces for
``step()`` (:meth:`ParamSync.sync`) and for each DDP bucket in overlap mode
(:meth:`ParamSync.start_gather`), and waits for them now or, deferred, before each read. With ``overlap_param_gather=True`` (opt-in; Megatron-LM's option of that name) ``step()``, or in
overlap mode the backward that ran the step, returns once the all-gather of the updated
parameters has *started*. Until it finishes, a parameter holds its previous value. This module
owns that window and makes every read of a parameter inside it that it can see wait or fail
loudly:

* a module's forward waits for every parameter under it (a global forward pre-hook): the
  model's call finishes them all before its own code runs, so a parent that reads a child's
  weight before the child runs reads it final;
* ``state_dict()`` of any module under one whose forward has run finishes every all-gather
  first (state-dict pre-hooks, registered on the first forward);
* under ``torch.compile`` the hook does nothing while traced: ``torch.compile(model)``'s
  wrapper runs it eagerly before the compiled region; ``model.compile()`` (compiled in place)
  has no eager call, so its reads are the next case;
* a parameter read while still in flight (outside any module's forward, before the model's
  call; a model compiled in place) gets a gradient while in flight: its gradient hook raises,
  naming the parameter and :meth:`ParamSync.finish` (``finish_param_sync()``), instead of
  training on a stale value. A read before the model's call with no gradient, or followed by
  that call before backward, is not seen: call ``finish_param_sync()`` first;
* everything else (this package's own readers: the next ``step()``, resharding, checkpoints)
  calls :meth:`ParamSync.finish`.

Off (the default), :meth:`ParamSync.defer` is never called and no hook is installed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from zero_functional import comm
from zero_functional.comm import Pending
from zero_functional.core.layout import bucket_layout, piece_view, views
from zero_functional.core.ownership import Ownership
from zero_functional.core.param_table import ParamTable
from zero_functional.core.partition import Piece
from zero_functional.core.plans import (
    BufferPlan,
    SyncPlan,
    bucket_view_groups,
    buffer_plan,
    send_list,
    sync_plan,
)
from zero_functional.shell.grad_sync import collectives_for

__all__ = ["ParamSync", "waited_by"]

Unit = tuple[Pending, Sequence[Tensor]]
Update = Callable[[Mapping[int, Tensor]], None]


Send = tuple[int, int, Piece]  # (global index, owner, piece)


@dataclass
class _Buffer:
    """A bucket view: ``params`` alias ``tensor``; its ``plan`` says who broadcasts which part
    (and the even shard, when ``all_gather_single`` can take it)."""

    tensor: Tensor
    plan: BufferPlan
    params: list[Tensor]


def waited_by(module: nn.Module) -> list[Tensor]:
    """The parameters ``module``'s forward waits for: its own, and those of its parameter
    containers (``ParameterList``/``ParameterDict`` children, which never run a forward).

    Example:
        >>> m = nn.Linear(2, 3)
        >>> [tuple(p.shape) for p in waited_by(m)]
        [(3, 2), (3,)]
        >>> class Holder(nn.Module):
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.ws = nn.ParameterList([nn.Parameter(torch.zeros(4))])
        ...         self.inner = nn.Linear(1, 1)
        >>> [tuple(p.shape) for p in waited_by(Holder())]  # not inner's: it has a forward
        [(4,)]
    """
    out: list[Tensor] = list(module.parameters(recurse=False))
    for child in module.children():
        if isinstance(child, nn.ParameterList | nn.ParameterDict):
            out.extend(child.parameters())
    return out


class ParamSync:
    """One optimizer's parameter storage, all-gathers, and the hooks that wait for them.

    Args:
        table: The optimizer's parameters (:class:`~zero_functional.core.param_table.ParamTable`).
        group: The process group the all-gathers run on.
        call: Names the collectives being waited for when they fail (``comm.call``).
        deferred: Whether all-gathers may be left in flight (``overlap_param_gather``); only
            then are hooks installed.
    """

    def __init__(
        self,
        table: ParamTable,
        group: comm.ProcessGroup,
        call: Callable[[str], AbstractContextManager[None]],
        deferred: bool,
    ) -> None:
        self.deferred = deferred
        self.group = group
        self.world_size = comm.group_size(group)
        self._call = call
        self._table = ParamTable((), ())  # set_params() below: every parameter is new
        self._buffers: list[_Buffer] = []
        self._sends: list[Send] = []
        self._plan = SyncPlan((), coalesced=False)
        self._ownership: Ownership | None = None
        self._in_flight: list[Pending] = []
        self._pending_for: dict[Tensor, list[Pending]] = {}
        self._handles: list[RemovableHandle] = []
        self._seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._names: dict[Tensor, str] = {}
        self.set_params(table)

    def set_params(self, table: ParamTable) -> None:
        """Track the parameters of ``table`` (after ``add_param_group``): gradient hooks on the
        new ones."""
        new = [p for p in table.params if p not in self._table]
        self._table = table
        if not self.deferred:
            return
        ref = weakref.ref(self)
        if not self._handles:
            # one global pre-hook: learns modules (for state_dict) and waits while in flight
            def before_forward(module: nn.Module, args: object) -> None:
                # traced (a module called inside a compiled region): nothing to do here; the
                # compiled module's own call ran this hook eagerly first, or nothing finished
                # the gathers and the gradient check names the read
                if torch.compiler.is_compiling():
                    return
                me = ref()
                if me is not None:
                    me._before_forward(module)

            self._handles.append(
                torch.nn.modules.module.register_module_forward_pre_hook(before_forward)
            )
        for p in new:
            if p.requires_grad:

                def on_grad(param: Tensor) -> None:
                    me = ref()
                    if me is not None:
                        me._check_not_in_flight(param)

                self._handles.append(p.register_post_accumulate_grad_hook(on_grad))  # type: ignore[no-untyped-call]

    def rebuild(self, ownership: Ownership, bucket_view: bool) -> None:
        """Follow ``ownership`` (and the parameters' ``requires_grad``): the send list and,
        with ``bucket_view``, the bucket views (parameters become views of one buffer per
        :func:`~zero_functional.core.plans.bucket_view_groups` group)."""
        self.finish()  # the old views may still be being written
        params = self._table.params
        self._ownership = ownership
        trainable = [p.requires_grad for p in params]
        self._sends = send_list(ownership, trainable)
        self._plan = self._sync_plan(self._sends, self.group)
        self._buffers = []
        if not bucket_view:
            return
        if ownership.is_whole:
            for p in params:
                if not p.requires_grad and p.data._base is not None:
                    p.data = p.data.detach().clone()  # leave a bucket without losing the value
        collectives = collectives_for(self.group, even=True)
        for members in bucket_view_groups(ownership, self._table.keys, trainable):
            ps = [params[k] for k in members]
            plan = buffer_plan(ownership, members, collectives)
            total = sum(p.numel() for p in ps)
            size = plan.chunk * self.world_size if plan.chunk is not None else total
            layout = bucket_layout([p.numel() for p in ps])
            # one parameter at a time: each old tensor is freed as soon as its slot is filled,
            # so building the views costs one buffer (its pages touched as they are filled),
            # not the buffer plus a flattened copy plus every old parameter
            buffer = torch.empty(size, dtype=ps[0].dtype, device=ps[0].device)
            buffer[total:].zero_()  # the even shards' padding
            for p, view in zip(ps, views(buffer, layout, [p.shape for p in ps])):
                view.copy_(p.detach())
                p.data = view
            self._buffers.append(_Buffer(buffer, plan, ps))

    @property
    def bucket_views(self) -> list[Tensor]:
        """The buffers the parameters are views of (empty without bucket views)."""
        return [b.tensor for b in self._buffers]

    def sync(self, grads: Mapping[int, Tensor] | None, update: Update) -> None:
        """``update`` this rank's pieces with ``grads`` (if given) and give every rank every
        owner's updated pieces: waited for now, or deferred. Without bucket views the update
        is pipelined: each owned unit of the plan is updated just before its broadcast is
        issued, while earlier units are on the wire."""
        if self.world_size == 1 or self._buffers:
            if grads is not None:
                update(grads)
            if self.world_size == 1:
                return
        if self._buffers:
            units: list[Unit] = [
                (
                    comm.start_broadcast(b.tensor, b.plan.runs, self.group, chunk=b.plan.chunk),
                    b.params,
                )
                for b in self._buffers
            ]
        else:
            todo = dict(grads) if grads is not None else {}
            units = self._gather(self._sends, self._plan, self.group, todo, update)
            if todo:  # owned pieces of frozen parameters (not synced)
                update(todo)
        self.defer(units)

    def start_gather(
        self, indices: Sequence[int], group: comm.ProcessGroup, plan: BufferPlan
    ) -> list[Unit]:
        """Start the all-gather of the parameters ``indices`` (one DDP bucket's, end to end,
        whose ``plan`` :func:`~zero_functional.core.plans.buffer_plan` gives): the units in flight
        and the parameters each writes."""
        params = self._table.params
        if plan.chunk is None:
            assert self._ownership is not None
            sends = [
                (k, rank, piece) for k in indices for rank, piece in self._ownership.holders(k)
            ]
            return self._gather(sends, self._sync_plan(sends, group), group, {}, None)
        # even shards: pack the bucket's parameters, all-gather, unpack (NCCL's fast path)
        ps = [params[k] for k in indices]
        with torch.no_grad():
            staging = torch.cat([p.detach().reshape(-1) for p in ps])
        pending = comm.start_broadcast(staging, plan.runs, group, chunk=plan.chunk)
        pending.finish.append(lambda: comm.unflatten_into(staging, ps))
        return [(pending, ps)]

    def _sync_plan(self, sends: Sequence[Send], group: comm.ProcessGroup) -> SyncPlan:
        """The broadcasts of ``sends`` (:func:`~zero_functional.core.plans.sync_plan`): a piece
        of part of a parameter is a contiguous view; a whole one is the parameter."""
        params = self._table.params
        return sync_plan(
            [rank for _, rank, _ in sends],
            [piece.numel for _, _, piece in sends],
            [self._table.keys[k] for k, _, _ in sends],
            [not piece.is_whole or params[k].is_contiguous() for k, _, piece in sends],
            nccl=comm.is_nccl(group),
        )

    def _gather(
        self,
        sends: Sequence[Send],
        plan: SyncPlan,
        group: comm.ProcessGroup,
        todo: dict[int, Tensor],
        update: Update | None,
    ) -> list[Unit]:
        """Broadcast each piece of ``sends`` from its owner, unit by unit of ``plan``; before a
        unit this rank owns goes out, ``update`` its pieces' gradients (taken from ``todo``)."""
        params, me = self._table.params, comm.group_rank(group)
        pieces = [piece_view(params[k], piece) for k, _, piece in sends]
        out: list[Unit] = []
        for batch in plan.batches():
            for unit in batch:
                if unit.owner == me and todo and update is not None:
                    ks = [sends[i][0] for i in unit.members]
                    mine = {k: todo.pop(k) for k in ks if k in todo}
                    if mine:
                        update(mine)
            calls = [([pieces[i] for i in u.members], u.owner, u.packed) for u in batch]
            covered = [params[sends[i][0]] for u in batch for i in u.members]
            out.append((comm.start_gather_units(calls, group), covered))
        return out

    @property
    def in_flight(self) -> bool:
        """Whether any all-gather is still in flight."""
        return bool(self._in_flight)

    def defer(self, units: Sequence[Unit]) -> None:
        """Leave ``units`` (a pending all-gather and the parameters it writes) in flight until
        their parameters are next read; without ``deferred``, wait for them now."""
        if not self.deferred:
            with self._call("the parameter all-gather"):
                for pending, _ in units:
                    pending.wait()
            return
        for pending, covered in units:
            self._in_flight.append(pending)
            for p in covered:
                self._pending_for.setdefault(p, []).append(pending)

    def finish(self) -> None:
        """Wait for every all-gather still in flight (a no-op when none is)."""
        in_flight, self._in_flight = self._in_flight, []
        self._pending_for = {}
        if in_flight:
            with self._call("the parameter all-gather of step()"):
                for pending in in_flight:
                    pending.wait()

    def close(self) -> None:
        """Finish what is in flight and remove every hook."""
        self.finish()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def name(self, p: Tensor) -> str:
        """How errors name ``p``: its name in the model where a forward showed it, and its
        index and shape."""
        k = self._table.index(p) if p in self._table else None
        where = f"parameter {k} of the optimizer" if k is not None else "a parameter"
        qualified = self._names.get(p)
        shape = tuple(p.shape)
        return f"{qualified!r} ({where}, shape {shape})" if qualified else f"{where} {shape}"

    def _before_forward(self, module: nn.Module) -> None:
        # every in-flight parameter under ``module``, not just its own: its forward may read a
        # child's weight before that child runs (the root's call finishes the whole model's)
        if module not in self._seen:
            self._learn(module)
        if not self._pending_for:
            return
        waits = [pending for p in module.parameters() for pending in self._pending_for.pop(p, ())]
        if waits:
            with self._call("the parameter all-gather of step(), before a forward"):
                for pending in waits:
                    pending.wait()
        if not self._pending_for:
            self.finish()

    def _learn(self, module: nn.Module) -> None:
        """First sight of ``module``: names for its parameters (the outermost module is called
        first, so names are the model's), and a state-dict pre-hook on it and on each module
        under it that holds ours (a compiled forward shows only its wrapper)."""
        if not self._names and any(p in self._table for p in module.parameters()):
            self._names = {p: n for n, p in module.named_parameters() if p in self._table}
        ref = weakref.ref(self)

        def before_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
            me = ref()
            if me is not None:
                me.finish()

        for m in module.modules():
            if m not in self._seen:
                self._seen.add(m)
                if any(p in self._table for p in m.parameters()):
                    self._handles.append(
                        m.register_state_dict_pre_hook(before_state_dict)  # type: ignore[no-untyped-call]
                    )

    def _check_not_in_flight(self, p: Tensor) -> None:
        if not all(pending.finished for pending in self._pending_for.get(p, ())):
            raise RuntimeError(
                f"{self.name(p)} was read while its all-gather from the last step was still in "
                "flight (overlap_param_gather=True): no eager forward of a module holding it ran "
                "before the read (a read outside the model's forward, or a model compiled in "
                "place by module.compile()), so it held the previous value. Call "
                "zero.finish_param_sync() before such a read, compile with "
                "torch.compile(model) (its wrapper's call waits), or build the optimizer with "
                "overlap_param_gather=False (the default)"
            )
