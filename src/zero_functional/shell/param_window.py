"""ParamWindow: parameters whose all-gather is still in flight, and who waits for them.

Off by default, as torch's contract: parameters are final when ``step()`` returns (in overlap
mode, the backward that ran it), for code that saves ``model.state_dict()``, reads a tied
weight or compares ranks then. With ``overlap_param_gather=True`` (opt-in, Megatron-LM's
option) the step returns once the all-gathers have *started*; until they finish a parameter
holds its previous value, and every read this window can see waits, or fails loudly:

* a module's forward waits for every parameter under it (a global forward pre-hook), so the
  model's call finishes them all before its own code runs;
* ``state_dict()`` of a module under one whose forward has run finishes them first;
* under ``torch.compile`` the hook does nothing while traced: ``torch.compile(model)``'s wrapper
  runs it eagerly first; ``model.compile()`` has none, so its reads are the next case;
* a parameter that gets a gradient while in flight raises, naming ``finish_param_sync()``;
* this package's own readers (the next step, a reshard, a save) call :meth:`ParamWindow.finish`.
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

InFlight = tuple[Pending, Sequence[Tensor]]  # an all-gather, and the parameters it writes


class ParamWindow:
    """One optimizer's parameter all-gathers in flight, and the hooks that wait for them.

    Example:
        >>> from contextlib import nullcontext
        >>> window = ParamWindow(ParamTable((), ()), lambda name: nullcontext(), deferred=False)
        >>> window.defer([(Pending([]), [])])  # not deferred: waited for now
        >>> window.finish()  # nothing in flight: a no-op
    """

    def __init__(
        self, table: ParamTable, call: Callable[[str], AbstractContextManager[None]], deferred: bool
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
        """Track the parameters of ``table`` (after ``add_param_group``)."""
        new = [p for p in table.params if p not in self._table]
        self._table = table
        if not self.deferred:
            return
        ref = weakref.ref(self)
        if not self._handles:
            # one global pre-hook: learns modules (for state_dict) and waits while in flight
            def before_forward(module: nn.Module, args: object) -> None:
                # traced: the compiled module's call ran this eagerly first (module docstring)
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

    def defer(self, units: Sequence[InFlight]) -> None:
        """Leave ``units`` in flight until their parameters are next read (else wait now)."""
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

    def name(self, p: Tensor) -> str:
        """How errors name ``p``: its name in the model (once a forward showed it), index, shape."""
        k = self._table.index(p) if p in self._table else None
        where = f"parameter {k} of the optimizer" if k is not None else "a parameter"
        qualified = self._names.get(p)
        shape = tuple(p.shape)
        return f"{qualified!r} ({where}, shape {shape})" if qualified else f"{where} {shape}"

    def _before_forward(self, module: nn.Module) -> None:
        # every parameter under ``module``: its forward may read a child's before the child runs
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
        """First sight of ``module``: its parameters' names, and state-dict pre-hooks under it."""
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
