"""LocalShard: this rank's pieces under one ownership, their gradients, state and update.

It issues no collective (the facade and the syncs run those around it); the state dicts are
the optimizer's own mapping, changed in place.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import OrderedDict
from collections.abc import (
    Callable,
    Hashable,
    Iterable,
    Iterator,
    Mapping,
    MutableMapping,
    Sequence,
)
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from zero_functional.core.blockwise import Range
from zero_functional.core.consolidation import Consolidation, to_cpu
from zero_functional.core.fingerprint import check_unfrozen
from zero_functional.core.layout import piece_view
from zero_functional.core.load_checks import StateSchema, check_shard_state
from zero_functional.core.main_params import (
    MAIN_KEY,
    main_dtype_for,
    main_value,
    step_through_main_,
    with_main,
)
from zero_functional.core.ownership import Ownership, Transfer
from zero_functional.core.param_table import ParamTable
from zero_functional.core.partition import Piece
from zero_functional.core.piece_state import join_states, placed, slice_state
from zero_functional.core.plans import ReshardPlan
from zero_functional.functional.registry import GROUP_CLASS_KEY
from zero_functional.shell.amp import unscaled
from zero_functional.shell.steppers import (
    LocalView,
    Stepper,
    converted_state,
    hyperparameters,
    instance_hyper,
    owned_params,
)

logger = logging.getLogger(__name__)

PieceStates = dict[int, dict[Transfer, dict[str, Any]]]


class RemainderTies:
    """The bf16 elements written that differ from torch's rounding of their main value, kept
    per device until read (so that a step adds no device sync).

    Example:
        >>> ties = RemainderTies()
        >>> ties.add(torch.tensor(2))
        >>> ties.total()
        2
    """

    def __init__(self) -> None:
        self.sums: dict[torch.device, Tensor] = {}

    def add(self, n: Tensor) -> None:
        """Add the 0-dim count ``n`` on its device."""
        now = self.sums.get(n.device)
        self.sums[n.device] = n if now is None else now + n

    def total(self) -> int:
        """The count so far (one sync per device)."""
        return sum(int(n.item()) for n in self.sums.values())


class LocalShard:
    """This rank's pieces under ``ownership`` and their state (``state``: the optimizer's own
    mapping; ``param_groups`` read at each call, so edits apply; ``name``: for messages).

    Example:
        >>> from zero_functional.functional import functional_spec
        >>> from zero_functional.shell.steppers import FunctionalStepper
        >>> from zero_functional.core.ownership import flat_ownership
        >>> w = torch.nn.Parameter(torch.ones(4))
        >>> groups, table = [{"params": [w], "lr": 0.5}], ParamTable.of([{"params": [w]}])
        >>> stepper = FunctionalStepper(functional_spec(torch.optim.SGD), compile=False)
        >>> shard = LocalShard(flat_ownership([4], 2), 1, table, groups, {w: {}}, stepper, "SGD")
        >>> shard.update({0: torch.ones(2)})  # rank 1's piece: elements 2 and 3
        >>> w.tolist()
        [1.0, 1.0, 0.5, 0.5]
    """

    def __init__(
        self,
        ownership: Ownership,
        rank: int,
        table: ParamTable,
        param_groups: list[dict[str, Any]],
        state: MutableMapping[Tensor, Any],
        stepper: Stepper,
        name: str,
        main_params_dtype: torch.dtype | None = None,
        remainders: RemainderTies | None = None,
        *,
        changes_gathered: bool = False,
    ) -> None:
        self.rank, self.table, self.param_groups, self.state = rank, table, param_groups, state
        self.name = name
        self.main_params_dtype = main_params_dtype
        # every parameter has a main copy and only the gather of changes writes the parameters
        self.changes_gathered = changes_gathered
        self.remainders = remainders
        self.hooks = UpdateHooks()
        self.book = Consolidation()  # so that state_dict() needs no collective
        self.refusal: str | None = None  # why no update may happen now (refusing_updates)
        self.adopt(ownership, stepper)

    @contextlib.contextmanager
    def refusing_updates(self, why: str) -> Iterator[None]:
        """Within the block, :meth:`check_updates` (every update, first) raises ``why``.

        Example:
            >>> from zero_functional.core.ownership import flat_ownership
            >>> groups = [{"params": [torch.zeros(2)]}]
            >>> table, ownership = ParamTable.of(groups), flat_ownership([2], 1)
            >>> shard = LocalShard(ownership, 0, table, groups, {}, Stepper(), "SGD")
            >>> with shard.refusing_updates("not now"):
            ...     shard.check_updates()
            Traceback (most recent call last):
            ...
            RuntimeError: not now
        """
        before, self.refusal = self.refusal, why
        try:
            yield
        finally:
            self.refusal = before

    def check_updates(self) -> None:
        """Raise the reason updates are refused now, if they are (:meth:`refusing_updates`)."""
        if self.refusal is not None:
            raise RuntimeError(self.refusal)

    def adopt(self, ownership: Ownership, stepper: Stepper) -> None:
        """Own the pieces ``ownership`` gives this rank (their state moved already)."""
        self.ownership, self.stepper = ownership, stepper
        self.pieces: dict[int, Piece] = {s.param: s for s in ownership.owned(self.rank)}
        self.trainable = [p.requires_grad for p in self.table.params]
        self._built_trainable = list(self.trainable)
        self._unchecked: set[int] = set()  # unfrozen, their gradients not yet compared
        self.reduced: dict[int, Tensor] = {}  # a hook's reduce_dtype values: hold_reduced

    def extend(self, ownership: Ownership, table: ParamTable) -> None:
        """Cover ``table``'s parameters under ``ownership``, the old one extended to them."""
        self.table = table
        self.adopt(ownership, self.stepper)

    def main_dtype(self, p: Tensor) -> torch.dtype | None:
        """The dtype of parameter ``p``'s main copy, ``None`` where it has none."""
        return main_dtype_for(p.dtype, self.main_params_dtype, self.changes_gathered)

    def piece(self, k: Hashable, what: str) -> Piece:
        """The piece of parameter ``k`` this rank owns; ValueError naming ``what`` if none."""
        piece = self.pieces.get(k) if isinstance(k, int) else None
        if piece is None:
            raise ValueError(
                f"{what} for parameter {k!r}, of which rank {self.rank} owns no piece: pass "
                f"the {what} of the pieces ownership.owned(rank) lists"
            )
        return piece

    def grads(self) -> dict[int, Tensor]:
        """Global index -> the gradient of this rank's piece (the held wide one, else .grad's)."""
        params, out = self.table.params, {}
        for k, piece in self.pieces.items():
            if (grad := params[k].grad) is not None:
                out[k] = view = piece_view(grad, piece)
                wide = self.reduced.pop(k, None)  # dropped where .grad changed since
                if wide is not None and torch.equal(wide.to(view.dtype).view_as(view), view):
                    out[k] = self.reduced[k] = wide.view_as(view)
        return out

    def hold_reduced(self, grads: Mapping[int, Tensor]) -> None:
        """Hold pieces' reduced gradients wider than ``.grad``, for the next step: :meth:`grads`."""
        self.reduced.update(grads)

    def round_reduced(self) -> None:
        """Write the held values, rounded, into ``.grad``'s pieces (after clipping scaled both)."""
        for k, wide in self.reduced.items():  # those grads() found current, as clipping asks
            if (grad := self.table.params[k].grad) is not None:
                (view := piece_view(grad, self.pieces[k])).copy_(wide.view_as(view))

    def pieces_stepper(self) -> Stepper:
        """The stepper; a RuntimeError where it steps whole parameters (``step()`` only)."""
        self.check_updates()
        if self.stepper.whole:
            raise RuntimeError(
                "update_owned needs an optimizer that runs on pieces; this one runs "
                f"{self.name} over whole parameters: call step()"
            )
        return self.stepper

    def update(self, grads: Mapping[int, Tensor]) -> None:
        """Step this rank's pieces with ``grads`` (global index -> gradient), one call per group."""
        self.hooks.before()
        stepper = self.pieces_stepper()
        params, group_of = self.table.params, self.table.group_of
        # per group: pieces, gradients, states, main dtypes, and each piece's whole parameter's
        # size (where a class decides its state on it: torchao's low-bit ones)
        by_group: dict[int, tuple[list[Tensor], list[Tensor], list[Any], list[Any], list[int]]] = {}
        for k, grad in grads.items():
            piece = self.piece(k, "gradients")
            if grad.is_sparse:
                raise RuntimeError(f"{self.name} does not support sparse gradients")
            p = params[k]
            view = piece_view(p, piece)
            ps, gs, ss, ds, ns = by_group.setdefault(group_of(k), ([], [], [], [], []))
            ps.append(view)
            gs.append(grad.view_as(view))
            ss.append(self.state[p])
            ds.append(self.main_dtype(p))
            ns.append(p.numel())
        self.book.changed()
        ties, remainders = self.remainders, self.remainders is not None
        for g, (ps, gs, ss, ds, ns) in sorted(by_group.items()):
            step = functools.partial(stepper.step_pieces, numels=ns)
            n = step_through_main_(
                step,
                self.param_groups[g],
                *(ps, gs, ss, ds),
                remainders=remainders,
                write_back=not self.changes_gathered,
            )
            if ties is not None and n is not None:
                ties.add(n)
        self.hooks.updated(self, grads)

    def local_step(
        self, closure: Callable[[], float] | None, grad_scale: Tensor | None = None, **kwargs: Any
    ) -> tuple[float | None, dict[int, Tensor] | None]:
        """This rank's part of ``step()`` before the sync: the closure's loss, and the pieces'
        gradients (unscaled by ``grad_scale``), or none where a whole-parameter stepper stepped."""
        if self.stepper.whole:
            self.hooks.before()
            loss = self.stepper.step_whole(self.param_groups, closure, **kwargs)
            self.hooks.updated(self, self.grads())
            return loss, None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = self.grads()
        self.reduced = {}  # used once: the next backward's reduction holds its own
        if grad_scale is not None:
            params = self.table.params
            dtypes = {k: self.main_dtype(params[k]) for k in grads}
            grads = unscaled(grads, dtypes, grad_scale)
        return loss, grads

    def check_trainable(self, ddp: bool) -> bool:
        """Whether ``requires_grad`` changed, or unfrozen parameters await a check."""
        params = self.table.params
        trainable = [p.requires_grad for p in params]
        if trainable == self.trainable:
            return bool(self._unchecked)
        woke = check_unfrozen(self._built_trainable, trainable, [p.shape for p in params], ddp)
        self._unchecked = set(woke)
        self.trainable = trainable
        return True

    def unchecked_grads(self) -> dict[int, Tensor]:
        """Global index -> the whole gradient of each unfrozen parameter not yet found averaged."""
        params = self.table.params
        return {k: g for k in sorted(self._unchecked) if (g := params[k].grad) is not None}

    def averaged(self, indices: Iterable[int]) -> None:
        """Note that the gradients of parameters ``indices`` were found averaged: they train."""
        self._unchecked.difference_update(indices)

    def local_view(self) -> Optimizer | LocalView:
        """This rank's share as a local optimizer shows it (torch's ``optim`` attribute)."""
        if self.stepper.whole and self.stepper.local is not None:
            return self.stepper.local
        owned = owned_params(self.param_groups, self.pieces)
        groups = [{**hyperparameters(g), "params": ps} for g, ps in zip(self.param_groups, owned)]
        return LocalView(groups, self.state)

    # ------------------------------------------------------------------ state in and out

    def shard_state(self) -> dict[int, tuple[Piece, dict[str, Any]]]:
        """Global index -> (this rank's piece, its state), a remainder given as its main value."""
        params = self.table.params
        return {
            k: (piece, self._leaving(k, piece))
            for k, piece in sorted(self.pieces.items())
            if self.state.get(params[k])
        }

    def _leaving(self, k: int, piece: Piece) -> dict[str, Any]:
        """Parameter ``k``'s state as it leaves this rank, held for ``piece`` (a remainder joined
        into its main: the bf16 piece stays here)."""
        p = self.table.params[k]
        state = self.state[p]
        if self.remainders is None:
            return cast(dict[str, Any], state)
        return with_main(piece_view(p, piece), state)

    def cpu_shard(self) -> dict[int, tuple[Range, dict[str, object]]]:
        """:meth:`shard_state` as it travels to a consolidating rank: ranges, CPU tensors."""
        return {k: ((s.start, s.stop), to_cpu(v)) for k, (s, v) in self.shard_state().items()}

    def cut(self, state: Mapping[int, Mapping[str, Any]]) -> dict[int, dict[str, object]]:
        """The states of this rank's pieces, cut from whole parameters' states (global index)."""
        params = self.table.params
        pieces = {
            k: slice_state(v, (0, params[k].numel()), (self.pieces[k].start, self.pieces[k].stop))
            for k, v in self.converted({k: v for k, v in state.items() if k in self.pieces}).items()
        }
        self.warn_without_main(pieces)
        return pieces

    def converted(self, states: Mapping[int, Mapping[str, Any]]) -> dict[int, Mapping[str, Any]]:
        """Loaded states as the groups' classes keep them, one warning per kind of conversion."""
        params, group_of = self.table.params, self.table.group_of
        out: dict[int, Mapping[str, Any]] = {}
        hows = set()
        for k, value in states.items():
            group = self.param_groups[group_of(k)]
            out[k], how = converted_state(self.stepper, group, value, params[k].numel())
            hows.add(how)
        for how in sorted(h for h in hows if h is not None):
            logger.warning(
                "the loaded optimizer state was %s on load for %s: %s",
                how,
                self.name,
                "it quantizes the moments of parameters of whole blocks, the loaded ones were fp32"
                if how == "quantized"
                else "it keeps full-precision moments, the loaded ones were quantized",
            )
        return out

    def warn_without_main(self, pieces: Mapping[int, Mapping[str, Any]]) -> None:
        """One warning where a piece that needs a main copy has loaded state without one."""
        params = self.table.params
        if any(
            v and MAIN_KEY not in v and main_dtype_for(params[k].dtype, self.main_params_dtype)
            for k, v in pieces.items()
        ):
            logger.warning(
                "the loaded state has no %r for some low-precision parameters: their main "
                "copies start from the parameters' values (rounded to their dtype)",
                MAIN_KEY,
            )

    def main_params(self) -> dict[Tensor, Tensor]:
        """This rank's main copies, keyed by parameter (those that need none are absent)."""
        params = self.table.params
        out: dict[Tensor, Tensor] = {}
        for k, piece in sorted(self.pieces.items()):
            p = params[k]
            if (dtype := self.main_dtype(p)) is not None:
                out[p] = main_value(piece_view(p, piece), self.state.get(p, {}), dtype).detach()
        return out

    def saved_groups(self) -> list[dict[str, Any]]:
        """The groups as a state dict carries them: a 0-d tensor where a group's class keeps one."""
        return [
            {**instance_hyper(self.stepper.for_group(g).tensor_keys, g), "params": g["params"]}
            for g in self.param_groups
        ]

    def check(
        self,
        state: Mapping[int, Mapping[str, Any]],
        saved_groups: Sequence[Mapping[str, Any]],
        schemas: Sequence[StateSchema | None],
    ) -> None:
        """Raise unless ``state`` fits this rank's pieces and ``saved_groups`` the groups."""
        params, group_of = self.table.params, self.table.group_of
        check_shard_state(
            state,
            saved_groups,
            self.param_groups,
            {k: (self.piece(k, "state"), params[k]) for k in state},
            [schemas[group_of(k)] for k in range(len(params))],
        )

    def _placed(
        self, p: Tensor, group: Mapping[str, Any], value: Mapping[str, object], copy: bool
    ) -> dict[str, object]:
        """``p``'s state with each value where and as it lives (:func:`~.piece_state.placed`)."""
        fp32_step = self.stepper.for_group(group).functional or bool(
            group.get("fused") or group.get("capturable")
        )
        dtype = self.main_dtype(p)
        return {
            key: placed(key, v, p, fp32_step=fp32_step, copy=copy, dtype=dtype)
            for key, v in value.items()
        }

    def install(
        self,
        pieces: Mapping[int, Mapping[str, Any]],
        saved_groups: Sequence[Mapping[str, Any]],
        *,
        copy: bool,
    ) -> None:
        """Replace this rank's state by ``pieces``, and the groups' hyperparameters."""
        params, group_of = self.table.params, self.table.group_of
        new = {
            params[k]: self._placed(params[k], self.param_groups[group_of(k)], value, copy)
            for k, value in self.converted(pieces).items()
        }
        for g, s in zip(self.param_groups, saved_groups):
            keys = self.stepper.for_group(g).tensor_keys
            for k, v in hyperparameters(s).items():
                if k in keys and isinstance(v, Tensor) and not isinstance(g.get(k), Tensor):
                    v = v.item()  # a number stays a number where the class keeps a tensor
                if k != GROUP_CLASS_KEY:  # this optimizer's (checked): a saved name adds none
                    g[k] = v
        self.state.clear()  # in place: a whole-parameter instance shares this mapping
        self.state.update(new)

    def outgoing(self, plan: ReshardPlan, old: Ownership) -> PieceStates:
        """Per destination rank, the state of each stretch ``plan`` sends, as held under ``old``."""
        params = self.table.params
        parts: PieceStates = {}
        for t in plan.sends:
            held = old.piece(self.rank, t.param)
            if held is not None and self.state.get(params[t.param]):
                state = self._leaving(t.param, held)
                part = slice_state(state, (held.start, held.stop), (t.start, t.stop))
                parts.setdefault(t.dst, {})[t] = part
        return parts

    def incoming(
        self, plan: ReshardPlan, new: Ownership, arrived: Mapping[Transfer, dict[str, Any]]
    ) -> None:
        """Replace the state of the pieces held by that of those under ``new``, from ``arrived``."""
        params, group_of = self.table.params, self.table.group_of
        for k in plan.held:
            self.state.pop(params[k], None)
        for k, moves in plan.receives.items():
            parts = [((t.start, t.stop), arrived[t]) for t in moves if t in arrived]
            piece, p = new.piece(self.rank, k), params[k]
            if not parts or piece is None:
                continue
            joined = join_states(parts, tuple(p.shape) if piece.is_whole else None)
            self.state[p] = self._placed(p, self.param_groups[group_of(k)], joined, copy=False)

    def values(self, indices: Iterable[int]) -> dict[int, Tensor]:
        """Global index -> this rank's piece now, flat: its main copy where it keeps one."""
        params = self.table.params
        out: dict[int, Tensor] = {}
        for k in indices:
            p, piece = params[k], self.piece(k, "values")
            view = piece_view(p, piece)
            dtype = self.main_dtype(p)
            # the fp32 main: kept, joined from a remainder, or (before a first step) upcast
            value = view if dtype is None else main_value(view, self.state.get(p, {}), dtype)
            out[k] = value.detach().reshape(-1)
        return out


Updated = Callable[[Mapping[int, Tensor]], None]  # given LocalShard.values, read-only
Resharded = Callable[[Ownership], None]  # given the old ownership, on every rank
Stepped = Callable[[], None]  # once a step (which updates in several calls) has ended


class UpdateHooks:
    """The callbacks run after this rank's pieces are updated and after the ownership changes.

    Example:
        >>> from zero_functional.core.ownership import flat_ownership
        >>> hooks = UpdateHooks()
        >>> handle = hooks.register(print, lambda old: print("was", old.owned(1)))
        >>> hooks.resharded(flat_ownership([4], 2))
        was (Piece(param=0, start=2, stop=4),)
    """

    def __init__(self) -> None:
        # an OrderedDict, which RemovableHandle can hold a weak reference to (a dict it cannot)
        self._hooks: OrderedDict[int, tuple[Updated, Resharded | None, Stepped | None]] = (
            OrderedDict()
        )
        self._before: OrderedDict[int, Callable[[], None]] = OrderedDict()

    def register_before(self, hook: Callable[[], None]) -> RemovableHandle:
        """Run ``hook()`` before the pieces, their state or the parameters next change (what
        holds them still until a copy of them is taken); the handle removes it."""
        handle = RemovableHandle(self._before)
        self._before[handle.id] = hook
        return handle

    def before(self) -> None:
        """Run every ``before`` hook: the pieces, their state or the parameters change next."""
        for hook in list(self._before.values()):
            hook()

    def register(
        self, updated: Updated, resharded: Resharded | None = None, stepped: Stepped | None = None
    ) -> RemovableHandle:
        """Add the callbacks, each run by the method of its name; the handle removes them."""
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = (updated, resharded, stepped)
        return handle

    def updated(self, shard: LocalShard, indices: Iterable[int]) -> None:
        """Run every ``updated`` hook on ``shard``'s new values of ``indices``."""
        if not self._hooks:
            return
        values = shard.values(indices)
        for updated, _, _ in list(self._hooks.values()):
            updated(values)

    def resharded(self, old: Ownership) -> None:
        """Run every ``resharded`` hook, given the ownership before the change."""
        for _, resharded, _ in list(self._hooks.values()):
            if resharded is not None:
                resharded(old)

    def stepped(self) -> None:
        """Run every ``stepped`` hook: a step has ended."""
        for _, _, stepped in list(self._hooks.values()):
            if stepped is not None:
                stepped()
