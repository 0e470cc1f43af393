"""ParamWindow: parameters whose all-gather is still in flight, and who waits for them.

With ``overlap_param_gather=True`` (opt-in; Megatron-LM's option of that name) ``step()``, or
in overlap mode the backward that ran the step, returns once the parameter all-gathers have
*started*; until they finish a parameter holds its previous value. This window holds those
gathers and makes every read it can see wait, or fail loudly:

* a module's forward waits for every parameter under it (a global forward pre-hook), so the
  model's call finishes them all before its own code runs (a parent may read a child's weight
  before the child runs);
* ``state_dict()`` of a module under one whose forward has run finishes them first;
* under ``torch.compile`` the hook does nothing while traced: ``torch.compile(model)``'s wrapper
  runs it eagerly first; ``model.compile()`` has no eager call, so its reads are the next case;
* a parameter that gets a gradient while still in flight raises, naming it and
  ``finish_param_sync()``, instead of training on a stale value;
* this package's own readers (the next step, resharding, checkpoints) call :meth:`finish`.

Off (the default) every gather handed over is waited for at once and no hook is installed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from zero_functional.comm import Pending
from zero_functional.core.param_table import ParamTable

__all__ = ["InFlight", "ParamWindow", "waited_by"]

InFlight = tuple[Pending, Sequence[Tensor]]
"""A parameter all-gather in flight, and the parameters it writes."""


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


class ParamWindow:
    """One optimizer's parameter all-gathers in flight, and the hooks that wait for them.

    Args:
        table: The optimizer's parameters.
        call: Names the collectives being waited for when they fail (``comm.call``).
        deferred: Whether gathers may be left in flight (``overlap_param_gather``); only then
            are hooks installed.
    """

    def __init__(
        self,
        table: ParamTable,
        call: Callable[[str], AbstractContextManager[None]],
        deferred: bool,
    ) -> None:
        self.deferred = deferred
        self._call = call
        self._table = ParamTable((), ())  # set_params() below: every parameter is new
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

    @property
    def in_flight(self) -> bool:
        """Whether any all-gather is still in flight."""
        return bool(self._in_flight)

    def defer(self, units: Sequence[InFlight]) -> None:
        """Leave ``units`` in flight until their parameters are next read; without
        ``deferred``, wait for them now."""
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
