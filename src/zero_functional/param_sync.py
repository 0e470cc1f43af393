"""ParamSync: parameter storage (bucket views) and the parameter all-gather, now or deferred.

The one owner of the parameters' storage and of the all-gathers in flight: it makes bucket
views (``parameters_as_bucket_view``), starts the all-gather of the owners' updated pieces for
``step()`` (:meth:`ParamSync.sync`) and for each DDP bucket in overlap mode
(:meth:`ParamSync.start_gather`), and waits for them now or, deferred, before each read. With ``overlap_param_gather=True`` (opt-in; Megatron-LM's option of that name) ``step()``, or in
overlap mode the backward that ran the step, returns once the all-gather of the updated
parameters has *started*. Until it finishes, a parameter holds its previous value. This module
owns that window and makes every read of a parameter inside it either wait or fail loudly:

* a module's forward waits for its own parameters (and those of its ``ParameterList`` /
  ``ParameterDict`` children, which have no forward of their own): a global forward pre-hook;
* ``module.state_dict()`` of any module whose forward has run finishes every all-gather first
  (a state-dict pre-hook registered on each such module the first time it runs);
* a parameter read outside any module's forward (``F.linear(x, model.wte.weight)`` before
  ``wte`` ran, ``module.forward(x)`` called directly) gets a gradient while still in flight:
  its gradient hook raises, naming the parameter and :meth:`ParamSync.finish`
  (``finish_param_sync()``), instead of training on a stale value;
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
from zero_functional.buckets import bucket_layout, views
from zero_functional.comm import Pending
from zero_functional.ownership import Ownership, Run, piece_view
from zero_functional.partition import Piece
from zero_functional.plans import bucket_view_groups, buffer_runs, choose_collectives, send_list

__all__ = ["ParamSync", "waited_by"]

Unit = tuple[Pending, Sequence[Tensor]]
Update = Callable[[Mapping[int, Tensor]], None]


@dataclass
class _Buffer:
    """A bucket view: ``params`` alias ``tensor``; ``runs`` say who broadcasts which part."""

    tensor: Tensor
    runs: tuple[Run, ...]
    chunk: int | None  # the even shard size when reduce_scatter/all_gather can take it
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
        params: The optimizer's parameters, in global index order.
        group: The process group the all-gathers run on.
        call: Names the collectives being waited for when they fail (``comm.call``).
        deferred: Whether all-gathers may be left in flight (``overlap_param_gather``); only
            then are hooks installed.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        group: comm.ProcessGroup,
        call: Callable[[str], AbstractContextManager[None]],
        deferred: bool,
    ) -> None:
        self.deferred = deferred
        self.group = group
        self.world_size = comm.group_size(group)
        self._call = call
        self._params: list[Tensor] = list(params)
        self._buffers: list[_Buffer] = []
        self._sends: list[tuple[int, int, Piece]] = []
        self._ownership: Ownership | None = None
        self._in_flight: list[Pending] = []
        self._pending_for: dict[Tensor, list[Pending]] = {}
        self._handles: list[RemovableHandle] = []
        self._seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._names: dict[Tensor, str] = {}
        self._index: dict[Tensor, int] = {}
        self.set_params(params)

    def set_params(self, params: Sequence[Tensor]) -> None:
        """Track ``params`` (after ``add_param_group``): gradient hooks on the new ones."""
        new = [p for p in params if p not in self._index]
        self._params = list(params)
        self._index = {p: i for i, p in enumerate(params)}
        if not self.deferred:
            return
        ref = weakref.ref(self)
        if not self._handles:
            # one global pre-hook: learns modules (for state_dict) and waits while in flight
            def before_forward(module: nn.Module, args: object) -> None:
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
        :func:`~zero_functional.plans.bucket_view_groups` group)."""
        self.finish()  # the old views may still be being written
        params = self._params
        self._ownership = ownership
        trainable = [p.requires_grad for p in params]
        self._sends = send_list(ownership, trainable)
        self._buffers = []
        if not bucket_view:
            return
        if ownership.is_whole:
            for p in params:
                if not p.requires_grad and p.data._base is not None:
                    p.data = p.data.detach().clone()  # leave a bucket without losing the value
        even = choose_collectives(comm.backend(self.group), self.world_size, even=True) == (
            "reduce_scatter+all_gather"
        )
        keys = [(str(p.device), str(p.dtype)) for p in params]
        for members in bucket_view_groups(ownership, keys, trainable):
            ps = [params[k] for k in members]
            runs, chunk = buffer_runs(ownership, members, even=even)
            total = sum(p.numel() for p in ps)
            size = chunk * self.world_size if chunk is not None else total
            layout = bucket_layout([p.numel() for p in ps])
            # one parameter at a time: each old tensor is freed as soon as its slot is filled,
            # so building the views costs one buffer (its pages touched as they are filled),
            # not the buffer plus a flattened copy plus every old parameter
            buffer = torch.empty(size, dtype=ps[0].dtype, device=ps[0].device)
            buffer[total:].zero_()  # the even shards' padding
            for p, view in zip(ps, views(buffer, layout, [p.shape for p in ps])):
                view.copy_(p.detach())
                p.data = view
            self._buffers.append(_Buffer(buffer, runs, chunk, ps))

    @property
    def bucket_views(self) -> list[Tensor]:
        """The buffers the parameters are views of (empty without bucket views)."""
        return [b.tensor for b in self._buffers]

    def sync(self, grads: Mapping[int, Tensor] | None, update: Update) -> None:
        """``update`` this rank's pieces with ``grads`` (if given) and give every rank every
        owner's updated pieces: waited for now, or deferred. Without bucket views the update
        is pipelined: each owned unit is updated just before its broadcast is issued, while
        earlier units are on the wire."""
        if self.world_size == 1 or self._buffers:
            if grads is not None:
                update(grads)
            if self.world_size == 1:
                return
        if self._buffers:
            units: list[Unit] = [
                (comm.start_broadcast(b.tensor, b.runs, self.group, chunk=b.chunk), b.params)
                for b in self._buffers
            ]
        else:
            todo = dict(grads) if grads is not None else None

            def before(ks: list[int]) -> None:
                assert todo is not None
                mine = {k: todo.pop(k) for k in ks if k in todo}
                if mine:
                    update(mine)

            units = self._start_units(self._sends, self.group, before if todo else None)
            if todo:  # owned pieces of frozen parameters (not synced)
                update(todo)
        self.defer(units)

    def start_gather(
        self,
        indices: Sequence[int],
        group: comm.ProcessGroup,
        runs: tuple[Run, ...],
        chunk: int | None,
    ) -> list[Unit]:
        """Start the all-gather of the parameters ``indices`` (one DDP bucket's, end to end,
        whose ``runs`` and even ``chunk`` :func:`~zero_functional.plans.buffer_runs` gives):
        the units in flight and the parameters each writes."""
        params = self._params
        if chunk is None:
            assert self._ownership is not None
            sends = [
                (k, rank, piece) for k in indices for rank, piece in self._ownership.holders(k)
            ]
            return self._start_units(sends, group, None)
        # even shards: pack the bucket's parameters, all-gather, unpack (NCCL's fast path)
        ps = [params[k] for k in indices]
        with torch.no_grad():
            staging = torch.cat([p.detach().reshape(-1) for p in ps])
        pending = comm.start_broadcast(staging, runs, group, chunk=chunk)
        pending.finish.append(lambda: comm.unflatten_into(staging, ps))
        return [(pending, ps)]

    def _start_units(
        self,
        sends: Sequence[tuple[int, int, Piece]],
        group: comm.ProcessGroup,
        before: Callable[[list[int]], None] | None,
    ) -> list[Unit]:
        """Broadcast each piece from its owner, small ones packed (:func:`comm.start_sync_units`);
        ``before`` gets the global indices of each unit this rank owns just before it goes."""
        params = self._params
        index = [k for k, _, _ in sends]
        started = comm.start_sync_units(
            [piece_view(params[k], piece) for k, _, piece in sends],
            [rank for _, rank, _ in sends],
            group,
            before=(lambda covered: before([index[i] for i in covered])) if before else None,
        )
        return [(pending, [params[index[i]] for i in covered]) for pending, covered in started]

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
        k = self._index.get(p)
        where = f"parameter {k} of the optimizer" if k is not None else "a parameter"
        qualified = self._names.get(p)
        shape = tuple(p.shape)
        return f"{qualified!r} ({where}, shape {shape})" if qualified else f"{where} {shape}"

    def _before_forward(self, module: nn.Module) -> None:
        if module not in self._seen:
            self._learn(module)
        if not self._pending_for:
            return
        waits = [pending for p in waited_by(module) for pending in self._pending_for.pop(p, ())]
        if waits:
            with self._call("the parameter all-gather of step(), before a forward"):
                for pending in waits:
                    pending.wait()
        if not self._pending_for:
            self.finish()

    def _learn(self, module: nn.Module) -> None:
        """First sight of ``module``: names for its parameters (the outermost module is called
        first, so names are the model's), and a state-dict pre-hook where it holds ours."""
        self._seen.add(module)
        mine = [p for p in waited_by(module) if p in self._index]
        if not self._names and any(p in self._index for p in module.parameters()):
            self._names = {p: n for n, p in module.named_parameters() if p in self._index}
        if mine:
            ref = weakref.ref(self)

            def before_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
                me = ref()
                if me is not None:
                    me.finish()

            self._handles.append(
                module.register_state_dict_pre_hook(before_state_dict)  # type: ignore[no-untyped-call]
            )

    def _check_not_in_flight(self, p: Tensor) -> None:
        # a unit waited for by another module's forward may have brought p along
        if not all(pending.finished for pending in self._pending_for.get(p, ())):
            raise RuntimeError(
                f"{self.name(p)} was read while its all-gather from the last step was still in "
                "flight (overlap_param_gather=True): it was used outside its own module's "
                "forward, so it held the previous value. Call zero.finish_param_sync() before "
                "such a read (e.g. a tied weight used directly in the loss), or build the "
                "optimizer with overlap_param_gather=False (the default)"
            )
