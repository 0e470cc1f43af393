"""ShardedEMA: an exponential moving average of the weights, each owner keeping its pieces'.

Each rank averages the pieces it owns right after it updates them (an update hook: no
collective), moves them with the ownership, and gathers them only to be read whole.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, cast

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

from zero_functional import comm
from zero_functional.core._validate import first_of
from zero_functional.core.layout import piece_view
from zero_functional.core.main_params import main_dtype_for
from zero_functional.core.ownership import Ownership, Transfer
from zero_functional.core.param_table import module_of
from zero_functional.core.partition import Piece
from zero_functional.core.plans import reshard_rounds
from zero_functional.optimizer import ZeroRedundancyOptimizer

SWAPPED = (
    "the optimizer cannot step inside `with ema.swapped_into(model):` (nor run overlap mode's "
    "step in a backward there): the block puts the trained parameters back when it ends, so "
    "the update would be lost while the optimizer's state and the EMA kept it; step after the "
    "block (swapped_into is for evaluating the averaged weights)"
)

MODULE_PREFIX = "module."  # of a parameter's key in the state dict, as AveragedModel's
N_AVERAGED_KEY = "n_averaged"  # AveragedModel's buffer of the number of updates averaged
T = TypeVar("T")


def _if_alive(method: Callable[[], Callable[[T], None] | None], arg: T) -> None:
    """``method()(arg)``, unless the weak ``method``'s object is gone."""
    if (bound := method()) is not None:
        bound(arg)


class ShardedEMA:
    """The EMA of an optimizer's parameters, each rank keeping its own pieces'.

    Equal to ``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=False)``
    updated after each step (a parameter without a gradient in a step is averaged as it is, as
    ``AveragedModel`` averages every parameter); ``model`` gives :meth:`state_dict` its names and
    buffers.

    Example:
        >>> from zero_functional import ZeroRedundancyOptimizer
        >>> model = nn.ParameterDict({"w": nn.Parameter(torch.ones(2))})
        >>> zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=1.0)
        >>> ema = ShardedEMA(zero, decay=0.5, model=model)
        >>> model.w.grad = torch.ones(2)  # w: 1 -> 0 -> -1 -> -2
        >>> _ = zero.step(), zero.step(), zero.step()  # its EMA: 0 -> -0.5 -> -1.25
        >>> with ema.swapped_into(model):  # the averaged weights, for evaluation
        ...     model.w.tolist()
        [-1.25, -1.25]
    """

    def __init__(
        self,
        optimizer: ZeroRedundancyOptimizer,
        decay: float = 0.999,
        *,
        model: nn.Module | None = None,
    ) -> None:
        self.multi_avg_fn = get_ema_multi_avg_fn(decay)  # type: ignore[no-untyped-call]
        self.optimizer = optimizer
        self.decay = decay
        self.model = model
        self._ownership = optimizer.ownership
        self._averages: dict[int, Tensor] = {}
        self._counts: dict[int, int] = {}
        self._fill_missing()
        self._this_step: set[int] = set()  # the pieces averaged in the step under way
        # weak: the optimizer's hooks do not keep this EMA alive
        update, reshard = weakref.WeakMethod(self.update_), weakref.WeakMethod(self.reshard)
        stepped = weakref.WeakMethod(self._stepped)
        self._handle = optimizer.register_update_hook(
            lambda values: _if_alive(update, values),
            lambda old: _if_alive(reshard, old),
            lambda: _if_alive(stepped, None),
        )

    def _owned(self) -> dict[int, Piece]:
        return {s.param: s for s in self._ownership.owned(self.optimizer.rank)}

    def _fill_missing(self, n_averaged: int = 0) -> None:
        """Average each owned piece without an average as its value now, ``n_averaged`` times."""
        params = self.optimizer.param_table.params
        mains = self.optimizer.main_params()
        for s in self._ownership.owned(self.optimizer.rank):
            if s.param not in self._averages:
                p = params[s.param]
                value = mains.get(p, piece_view(p, s))
                self._averages[s.param] = value.detach().reshape(-1).clone()
                self._counts[s.param] = n_averaged

    def close(self) -> None:
        """Stop following the optimizer (remove its update hook)."""
        self._handle.remove()

    @property
    def pieces(self) -> dict[int, Tensor]:
        """Global index -> this rank's averaged piece, flat (read it, do not write it)."""
        return dict(self._averages)

    def update_(self, values: Mapping[int, Tensor]) -> None:
        """Average in the new values of this rank's pieces (global index -> flat values); local.

        Example:
            >>> from zero_functional import ZeroRedundancyOptimizer as Zero
            >>> ema = ShardedEMA(Zero([torch.ones(2, requires_grad=True)], torch.optim.SGD), 0.5)
            >>> ema.update_({0: torch.tensor([4.0, 2.0])})  # the first update copies
            >>> ema.update_({0: torch.tensor([0.0, 0.0])})  # later ones lerp by 1 - decay
            >>> ema.pieces, ema.n_averaged(), ema.names(), ema.memory()
            ({0: tensor([2., 1.])}, 2, ['0'], (8, 2))
        """
        with torch.no_grad():
            groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
            for k, value in values.items():
                average = self._averages[k]
                if self._counts[k] == 0:
                    average.copy_(value.reshape(-1))
                else:
                    emas, news = groups.setdefault((average.device, average.dtype), ([], []))
                    emas.append(average)
                    news.append(value.reshape(-1))
                self._counts[k] += 1
                self._this_step.add(k)
            for emas, news in groups.values():
                self.multi_avg_fn(emas, news, None)

    def _stepped(self, _: None) -> None:
        """A step has ended: average in, as they are, the pieces it did not update (no gradient)."""
        if missed := [k for k in self._averages if k not in self._this_step]:
            self.update_(self.optimizer.shard.values(missed))
        self._this_step.clear()

    def reshard(self, old: Ownership) -> None:
        """Follow the optimizer's ownership from ``old``, moving the averages; collective.

        Example:
            >>> from zero_functional import ZeroRedundancyOptimizer as Zero
            >>> zero = Zero([torch.ones(2, requires_grad=True)], torch.optim.SGD)
            >>> ema = ShardedEMA(zero)
            >>> zero.add_param_group({"params": [torch.zeros(3, requires_grad=True)]})
            >>> ema.pieces  # the new parameter's average: its value, until it is updated
            {0: tensor([1., 1.]), 1: tensor([0., 0., 0.])}
        """
        zero, rank = self.optimizer, self.optimizer.rank
        new, group = zero.ownership, zero.process_group
        device = comm.collective_device(group, zero.param_table.params[0].device)
        for plan in reshard_rounds(old, new, rank):  # as the optimizer's state moves
            parts: dict[int, dict[Transfer, tuple[Tensor, int]]] = {}
            for t in plan.sends:
                held, average = old.piece(rank, t.param), self._averages.get(t.param)
                if held is not None and average is not None:
                    part = average[t.start - held.start : t.stop - held.start]
                    parts.setdefault(t.dst, {})[t] = (part.clone(), self._counts[t.param])
            arrived = parts.pop(rank, {})
            with comm.call("ShardedEMA.reshard()", group, timeout=zero.timeout):
                for got in comm.exchange_objects(parts, plan.pairs, group, device).values():
                    arrived.update(cast(dict[Transfer, tuple[Tensor, int]], got))
            for k in plan.held:
                self._averages.pop(k, None)
                self._counts.pop(k, None)
            for k, moves in plan.receives.items():
                got = [arrived[t] for t in moves if t in arrived]
                if got and len(got) == len(moves) and new.piece(rank, k) is not None:
                    like = zero.param_table.params[k]
                    average = torch.cat([part for part, _ in got])
                    self._averages[k] = average.to(like.device)
                    self._counts[k] = min(n for _, n in got)
        self._ownership = new
        # a new parameter was constant until now: its average is its value, as many times
        self._fill_missing(self.n_averaged())

    # ------------------------------------------------------------------ read whole

    def n_averaged(self) -> int:
        """The number of updates averaged (the most any parameter has had); collective."""
        zero = self.optimizer
        local = torch.tensor(max(self._counts.values(), default=0), dtype=torch.float64)
        with comm.call("ShardedEMA.n_averaged()", zero.process_group, timeout=zero.timeout):
            return int(comm.all_reduce_scalar(local, zero.process_group, op="max").item())

    def names(self) -> list[str]:
        """Each of the optimizer's parameters' name in the model (its index without one)."""
        return self.optimizer.param_table.names(self.model, strict=False)

    def state_dict(self) -> dict[str, Any]:
        """The whole EMA in ``AveragedModel``'s layout, on every rank; collective.

        Example:
            >>> from zero_functional import ZeroRedundancyOptimizer as Zero
            >>> model = nn.Linear(1, 1)
            >>> ema = ShardedEMA(Zero(model.parameters(), torch.optim.SGD), model=model)
            >>> torch.optim.swa_utils.AveragedModel(model).load_state_dict(ema.state_dict())
            <All keys matched successfully>
        """
        zero = self.optimizer
        params = zero.param_table.params
        owned = self._owned()
        mine = {k: ((owned[k].start, owned[k].stop), t.cpu()) for k, t in self._averages.items()}
        with comm.call("ShardedEMA.state_dict()", zero.process_group, timeout=zero.timeout):
            every = comm.all_gather_objects(mine, zero.process_group)
        n = self.n_averaged()
        dtypes = [main_dtype_for(p.dtype, zero.main_params_dtype) or p.dtype for p in params]
        whole = [torch.empty(p.numel(), dtype=d) for p, d in zip(params, dtypes)]
        for got in cast(list[dict[int, tuple[tuple[int, int], Tensor]]], every):
            for k, ((start, stop), t) in got.items():
                whole[k][start:stop] = t
        by_param = {p: w.view(p.shape).to(p.device) for p, w in zip(params, whole)}
        out: dict[str, Any] = {}
        if self.model is None:
            out.update({MODULE_PREFIX + n_: by_param[p] for n_, p in zip(self.names(), params)})
        else:
            for name, t in module_of(self.model).state_dict(keep_vars=True).items():
                value = by_param.get(t, t) if isinstance(t, Tensor) else t
                out[MODULE_PREFIX + name] = value.detach().clone() if value is t else value
        out[N_AVERAGED_KEY] = torch.tensor(n, dtype=torch.long)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load this rank's pieces of a whole EMA in ``AveragedModel``'s layout; local.

        Example:
            >>> from zero_functional import ZeroRedundancyOptimizer as Zero
            >>> ema = ShardedEMA(Zero([torch.ones(2, requires_grad=True)], torch.optim.SGD))
            >>> ema.load_state_dict({"module.0": torch.zeros(2), "n_averaged": torch.tensor(3)})
            >>> ema.pieces, ema.n_averaged()
            ({0: tensor([0., 0.])}, 3)
        """
        params, names = self.optimizer.param_table.params, self.names()
        keys = {k: MODULE_PREFIX + names[k] for k in self._averages}
        missing = [key for key in keys.values() if key not in state_dict]
        if missing or N_AVERAGED_KEY not in state_dict:
            raise KeyError(
                f"this EMA state dict lacks {missing or [N_AVERAGED_KEY]}: pass the state_dict() "
                "of a ShardedEMA (or an AveragedModel) of this model"
            )
        pieces = {}
        for k, piece in self._owned().items():
            whole = state_dict[keys[k]]
            if whole.numel() != params[k].numel():
                raise ValueError(
                    f"{keys[k]} has {whole.numel()} elements, the parameter "
                    f"{params[k].numel()}: pass the EMA of this model"
                )
            pieces[k] = whole.detach().reshape(-1)[piece.start : piece.stop]
        self.load_pieces(pieces, int(state_dict[N_AVERAGED_KEY]))

    def load_pieces(self, pieces: Mapping[int, Tensor], n_averaged: int) -> None:
        """Replace this rank's averages by ``pieces`` (flat), ``n_averaged`` times over; local."""
        if lacking := sorted(set(self._averages) - set(pieces)):
            raise ValueError(f"no EMA values for the owned parameters {first_of(lacking)}")
        self.optimizer.shard.hooks.before()  # a snapshot copies the averages first
        with torch.no_grad():
            for k, average in self._averages.items():
                average.copy_(pieces[k].reshape(-1))
                self._counts[k] = n_averaged

    @contextlib.contextmanager
    def swapped_into(self, model: nn.Module) -> Iterator[nn.Module]:
        """The averaged weights in ``model`` for the ``with`` block, restored after; collective."""
        zero = self.optimizer
        params = zero.param_table.params
        held = {id(p) for p in module_of(model).parameters()}
        if not all(id(p) in held for p in params):
            raise ValueError(
                "swapped_into(model) needs the model the optimizer was built from: some of "
                "the optimizer's parameters are not the model's"
            )
        zero.finish_param_sync()
        zero.shard.hooks.before()  # the parameters change: a snapshot copies them first
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for k, piece in self._owned().items():
                view = piece_view(params[k], piece)
                view.copy_(self._averages[k].view(view.shape))
        with comm.call("ShardedEMA.swapped_into()", zero.process_group, timeout=zero.timeout):
            zero.gather_params()
        try:
            with zero.shard.refusing_updates(SWAPPED):
                yield model
        finally:
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)

    def memory(self) -> tuple[int, int]:
        """This rank's EMA bytes and the optimizer's elements."""
        own = sum(t.numel() * t.element_size() for t in self._averages.values())
        return own, sum(math.prod(p.shape) for p in self.optimizer.param_table.params)
