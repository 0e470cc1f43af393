"""ShardedEMA: an exponential moving average of the weights, each owner keeping its pieces'.

The EMA is elementwise, so each rank averages the pieces it owns, right after it updates them
(:meth:`~zero_functional.optimizer.ZeroRedundancyOptimizer.register_update_hook`: every mode,
no collective), from the fp32 main copy where there is one: 4/N bytes per element per rank.
It moves with the optimizer's ownership (overlap mode's first backward, ``add_param_group``,
``reshard()``) as the optimizer state does, and is gathered only to be read whole:
:meth:`ShardedEMA.state_dict` (torch's ``AveragedModel`` layout) and
:meth:`ShardedEMA.swapped_into` (the averaged weights in the model, for evaluation).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

from zero_functional import comm
from zero_functional.core._validate import first_of
from zero_functional.core.layout import piece_view
from zero_functional.core.main_params import main_dtype_for
from zero_functional.core.ownership import Ownership, Transfer
from zero_functional.core.partition import Piece
from zero_functional.core.plans import plan_moves

if TYPE_CHECKING:
    from zero_functional.optimizer import ZeroRedundancyOptimizer

__all__ = ["MODULE_PREFIX", "N_AVERAGED_KEY", "ShardedEMA"]

MODULE_PREFIX = "module."
"""The prefix of a parameter's key in :meth:`ShardedEMA.state_dict` (``AveragedModel``'s)."""
N_AVERAGED_KEY = "n_averaged"
"""The key of the number of averaged updates (``AveragedModel``'s buffer of that name)."""


def _updated(ref: weakref.ReferenceType[ShardedEMA], values: Mapping[int, Tensor]) -> None:
    ema = ref()
    if ema is not None:
        ema.update_(values)


def _resharded(ref: weakref.ReferenceType[ShardedEMA], old: Ownership) -> None:
    ema = ref()
    if ema is not None:
        ema.reshard(old)


class ShardedEMA:
    """The EMA of a :class:`~zero_functional.optimizer.ZeroRedundancyOptimizer`'s parameters,
    each rank keeping its own pieces'.

    Equal to ``torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=
    get_ema_multi_avg_fn(decay), use_buffers=False)`` updated after each step: the first update
    copies the weights, each later one is ``ema.lerp_(weights, 1 - decay)``. A parameter is
    averaged when its pieces are updated (one without a gradient in a step is not).

    Args:
        optimizer: The optimizer whose pieces are averaged (of their main copies where it
            keeps them: ``main_params_dtype=``).
        decay: In ``[0, 1]``, as ``get_ema_multi_avg_fn``'s.
        model: The model, for the names of :meth:`state_dict` (``"module.<name>"``) and its
            buffers as they are now (``use_buffers=False`` keeps them so); else indices.

    Example:
        >>> import torch.distributed as dist, zero_functional as zf
        >>> model = nn.ParameterDict({"w": nn.Parameter(torch.ones(2))})
        >>> zero = zf.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=1.0)
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
        ref = weakref.ref(self)  # the optimizer's hooks do not keep this EMA alive
        self._handle = optimizer.register_update_hook(
            lambda values: _updated(ref, values), lambda old: _resharded(ref, old)
        )

    def _owned(self) -> dict[int, Piece]:
        return {s.param: s for s in self._ownership.owned(self.optimizer.rank)}

    def _fill_missing(self, n_averaged: int = 0) -> None:
        """Average each owned piece that has no average yet as its values now, averaged
        ``n_averaged`` times (at 0 its first update copies)."""
        params = self.optimizer.param_table.params
        mains = self.optimizer.main_params()
        for s in self._ownership.owned(self.optimizer.rank):
            if s.param not in self._averages:
                p = params[s.param]
                value = mains.get(p, piece_view(p, s))
                self._averages[s.param] = value.detach().reshape(-1).clone()
                self._counts[s.param] = n_averaged

    def close(self) -> None:
        """Stop following the optimizer (its updates no longer reach this EMA).

        Example:
            >>> import torch.distributed as dist, zero_functional as zf
            >>> model = nn.ParameterDict({"w": nn.Parameter(torch.ones(2))})
            >>> zero = zf.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=1.0)
            >>> ema = ShardedEMA(zero, decay=0.5, model=model)
            >>> model.w.grad = torch.ones(2)  # w: 1 -> 0 -> -1; its EMA: 0 -> -0.5
            >>> _ = zero.step(), zero.step()
            >>> ema.close()
            >>> _ = zero.step()
            >>> model.w.tolist(), ema.pieces  # the EMA did not follow
            ([-2.0, -2.0], {0: tensor([-0.5000, -0.5000])})
        """
        self._handle.remove()

    @property
    def pieces(self) -> dict[int, Tensor]:
        """Global index -> this rank's averaged piece, flat (read it, do not write it).

        Example:
            >>> import torch.distributed as dist, zero_functional as zf
            >>> model = nn.ParameterDict({"w": nn.Parameter(torch.ones(2))})
            >>> zero = zf.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=1.0)
            >>> ema = ShardedEMA(zero, decay=0.5, model=model)
            >>> model.w.grad = torch.ones(2)  # w: 1 -> 0 -> -1; its EMA: 0 -> -0.5
            >>> _ = zero.step(), zero.step()
            >>> ema.pieces
            {0: tensor([-0.5000, -0.5000])}
        """
        return dict(self._averages)

    def update_(self, values: Mapping[int, Tensor]) -> None:
        """Average in the new values of this rank's pieces (global index -> flat values): the
        first update of a piece copies, later ones ``lerp_`` by ``1 - decay``; local. The
        optimizer calls it after each update (``register_update_hook``).

        Example:
            >>> import torch.distributed as dist, zero_functional as zf
            >>> w = nn.Parameter(torch.ones(2))
            >>> ema = ShardedEMA(zf.ZeroRedundancyOptimizer([w], torch.optim.SGD), decay=0.5)
            >>> ema.update_({0: torch.tensor([4.0, 2.0])})  # the first update copies
            >>> ema.update_({0: torch.tensor([0.0, 0.0])})  # later ones lerp by 1 - decay
            >>> ema.pieces, ema.n_averaged()
            ({0: tensor([2., 1.])}, 2)
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
            for emas, news in groups.values():
                self.multi_avg_fn(emas, news, None)

    def reshard(self, old: Ownership) -> None:
        """Follow the optimizer's ownership from ``old`` (or an extension of this EMA's, after
        ``add_param_group``): each stretch of an average moves to its new owner; collective.
        The optimizer calls it after each change of ownership.

        Example:
            >>> import torch.distributed as dist, zero_functional as zf
            >>> model = nn.ParameterDict({"w": nn.Parameter(torch.ones(2))})
            >>> zero = zf.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=1.0)
            >>> ema = ShardedEMA(zero, decay=0.5, model=model)
            >>> zero.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
            >>> ema.pieces  # the new parameter's average: its value, until it is updated
            {0: tensor([1., 1.]), 1: tensor([0., 0., 0.])}
        """
        zero, rank = self.optimizer, self.optimizer.rank
        new = zero.ownership
        plan = plan_moves(old, new, rank)
        parts: dict[int, dict[Transfer, tuple[Tensor, int]]] = {}
        for t in plan.sends:
            held, average = old.piece(rank, t.param), self._averages.get(t.param)
            if held is not None and average is not None:
                part = average[t.start - held.start : t.stop - held.start]
                parts.setdefault(t.dst, {})[t] = (part.clone(), self._counts[t.param])
        arrived = parts.pop(rank, {})
        device = comm.collective_device(zero.process_group, zero.param_table.params[0].device)
        with comm.call("ShardedEMA.reshard()", zero.process_group, timeout=zero.timeout):
            received = comm.exchange_objects(parts, list(plan.pairs), zero.process_group, device)
        for payload in received.values():
            arrived.update(cast(dict[Transfer, tuple[Tensor, int]], payload))
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
        """The number of updates averaged (the most any parameter has had); collective.

        Example:
            >>> import torch.distributed as dist, zero_functional as zf
            >>> model = nn.ParameterDict({"w": nn.Parameter(torch.ones(2))})
            >>> zero = zf.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=1.0)
            >>> ema = ShardedEMA(zero, decay=0.5, model=model)
            >>> model.w.grad = torch.ones(2)  # w: 1 -> 0 -> -1; its EMA: 0 -> -0.5
            >>> _ = zero.step(), zero.step()
            >>> ema.n_averaged()
            2
        """
        zero = self.optimizer
        local = torch.tensor(max(self._counts.values(), default=0), dtype=torch.float64)
        with comm.call("ShardedEMA.n_averaged()", zero.process_group, timeout=zero.timeout):
            return int(comm.all_reduce_scalar(local, zero.process_group, op="max").item())

    def names(self) -> list[str]:
        """Each of the optimizer's parameters' name in the model (its index without one).

        Example:
            >>> import torch.distributed as dist, zero_functional as zf
            >>> model = nn.ParameterDict({"w": nn.Parameter(torch.ones(2))})
            >>> zero = zf.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=1.0)
            >>> ema = ShardedEMA(zero, decay=0.5, model=model)
            >>> ema.names(), ShardedEMA(zero).names()
            (['w'], ['0'])
        """
        return self.optimizer.param_table.names(self.model, strict=False)

    def state_dict(self) -> dict[str, Any]:
        """The whole EMA in ``AveragedModel``'s layout (``"module.<name>"`` for each parameter
        and buffer of the model, ``"n_averaged"``), on every rank; collective (every rank's
        pieces are gathered to every rank).

        Example:
            >>> import torch.distributed as dist, zero_functional as zf
            >>> model = nn.ParameterDict({"w": nn.Parameter(torch.ones(2))})
            >>> zero = zf.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=1.0)
            >>> ema = ShardedEMA(zero, decay=0.5, model=model)
            >>> model.w.grad = torch.ones(2)  # w: 1 -> 0 -> -1; its EMA: 0 -> -0.5
            >>> _ = zero.step(), zero.step()
            >>> ema.state_dict()
            {'module.w': tensor([-0.5000, -0.5000]), 'n_averaged': tensor(2)}
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
            for name, t in _module(self.model).state_dict(keep_vars=True).items():
                value = by_param.get(t, t) if isinstance(t, Tensor) else t
                out[MODULE_PREFIX + name] = value.detach().clone() if value is t else value
        out[N_AVERAGED_KEY] = torch.tensor(n, dtype=torch.long)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load this rank's pieces of a whole EMA in ``AveragedModel``'s layout (written at any
        world size); local.

        Raises:
            KeyError: A parameter or ``n_averaged`` is missing, naming it.
            ValueError: A parameter's average has another number of elements.

        Example:
            >>> import torch.distributed as dist, zero_functional as zf
            >>> model = nn.ParameterDict({"w": nn.Parameter(torch.ones(2))})
            >>> zero = zf.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=1.0)
            >>> ema = ShardedEMA(zero, decay=0.5, model=model)
            >>> from torch.optim.swa_utils import AveragedModel
            >>> reference = AveragedModel(model, multi_avg_fn=ema.multi_avg_fn)
            >>> reference.update_parameters(model)
            >>> ema.load_state_dict(reference.state_dict())
            >>> ema.pieces, ema.n_averaged()
            ({0: tensor([1., 1.])}, 1)
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
        """Replace this rank's averages by ``pieces`` (global index -> this rank's piece, flat:
        what a checkpoint reader cut) and their counts by ``n_averaged``; local (ValueError
        when an owned parameter lacks its piece).

        Example:
            >>> import torch.distributed as dist, zero_functional as zf
            >>> w = nn.Parameter(torch.ones(2))
            >>> ema = ShardedEMA(zf.ZeroRedundancyOptimizer([w], torch.optim.SGD), decay=0.5)
            >>> ema.load_pieces({0: torch.tensor([3.0, 4.0])}, n_averaged=7)
            >>> ema.pieces, ema.n_averaged()
            ({0: tensor([3., 4.])}, 7)
        """
        lacking = sorted(set(self._averages) - set(pieces))
        if lacking:
            raise ValueError(f"no EMA values for the owned parameters {first_of(lacking)}")
        with torch.no_grad():
            for k, average in self._averages.items():
                average.copy_(pieces[k].reshape(-1))
                self._counts[k] = n_averaged

    @contextlib.contextmanager
    def swapped_into(self, model: nn.Module) -> Iterator[nn.Module]:
        """The averaged weights in ``model`` (the optimizer's parameters: one all-gather) for
        the ``with`` block; the training weights are restored after it, bitwise; collective.

        Raises:
            ValueError: ``model`` does not hold the optimizer's parameters.

        Example:
            >>> import torch.distributed as dist, zero_functional as zf
            >>> model = nn.ParameterDict({"w": nn.Parameter(torch.ones(2))})
            >>> zero = zf.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=1.0)
            >>> ema = ShardedEMA(zero, decay=0.5, model=model)
            >>> model.w.grad = torch.ones(2)  # w: 1 -> 0 -> -1; its EMA: 0 -> -0.5
            >>> _ = zero.step(), zero.step()
            >>> with ema.swapped_into(model):
            ...     model.w.tolist()  # the averaged weights
            [-0.5, -0.5]
            >>> model.w.tolist()  # the training weights, bitwise
            [-1.0, -1.0]
        """
        zero = self.optimizer
        params = zero.param_table.params
        held = {id(p) for p in _module(model).parameters()}
        if not all(id(p) in held for p in params):
            raise ValueError(
                "swapped_into(model) needs the model the optimizer was built from: some of "
                "the optimizer's parameters are not the model's"
            )
        zero.finish_param_sync()
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for k, piece in self._owned().items():
                view = piece_view(params[k], piece)
                view.copy_(self._averages[k].view(view.shape))
        with comm.call("ShardedEMA.swapped_into()", zero.process_group, timeout=zero.timeout):
            zero.gather_params()
        try:
            yield model
        finally:
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)

    def memory(self) -> tuple[int, int]:
        """This rank's EMA bytes and the optimizer's elements (for ``bytes / (elements / N)``).

        Example:
            >>> import torch.distributed as dist, zero_functional as zf
            >>> w = nn.Parameter(torch.ones(2))
            >>> ema = ShardedEMA(zf.ZeroRedundancyOptimizer([w], torch.optim.SGD), decay=0.5)
            >>> ema.memory()  # 2 fp32 averages of 2 elements on the only rank
            (8, 2)
        """
        own = sum(t.numel() * t.element_size() for t in self._averages.values())
        return own, sum(math.prod(p.shape) for p in self.optimizer.param_table.params)


def _module(model: nn.Module) -> nn.Module:
    """The wrapped module of a ``DistributedDataParallel``, else the model itself."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model
