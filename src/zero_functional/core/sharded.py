"""The functional ZeRO step for custom training loops (``torch.func`` and friends).

:func:`shard_init` builds state for the pieces this rank owns and :func:`shard_update` updates
them purely; ``comm.reduce_to_owners`` and ``comm.sync_params`` (over ``piece_views(tensors,
ownership)``) move the gradients and parameters around it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, overload

import torch
from torch import Tensor

from zero_functional.core._validate import first_of
from zero_functional.core.layout import piece_view
from zero_functional.core.ownership import Ownership, whole_ownership
from zero_functional.core.partition import Piece, owners
from zero_functional.functional import FunctionalOptimizer, State

Params = Mapping[str, Tensor] | Sequence[Tensor]
OwnershipLike = Ownership | Sequence[Sequence[int]]


class ShardState(NamedTuple):
    """The state of this rank's ``pieces`` (as ``ownership.owned(rank)`` lists them)."""

    pieces: tuple[Piece, ...]
    inner: State


def _as_list(params: Params) -> list[Tensor]:
    return list(params.values()) if isinstance(params, Mapping) else list(params)


def _ownership(ownership: OwnershipLike, params: Sequence[Tensor]) -> Ownership:
    """An Ownership, or a whole-tensor partition (per rank, its parameter indices) as one."""
    numels = tuple(p.numel() for p in params)
    if not isinstance(ownership, Ownership):
        return whole_ownership(numels, owners(ownership, len(params)), len(ownership))
    if ownership.numels != numels:
        raise ValueError(
            f"the ownership was built for parameter sizes {first_of(ownership.numels)} "
            f"({len(ownership.numels)} parameters), these are {first_of(numels)} "
            f"({len(params)}): build it from these parameters, in order"
        )
    return ownership


def shard_init(
    opt: FunctionalOptimizer, params: Params, ownership: OwnershipLike, rank: int
) -> ShardState:
    """State for the pieces of ``params`` (a list, or a dict in model order) that ``rank`` owns
    under ``ownership`` (or a whole-tensor partition), and nothing for the rest.

    Example:
        >>> from zero_functional.functional import sgd
        >>> shard_init(sgd(momentum=0.9), [torch.zeros(4)], [[], [0]], rank=0).pieces
        ()
    """
    flat = _as_list(params)
    own = _ownership(ownership, flat)
    pieces = own.owned(rank)
    return ShardState(pieces, opt.init([piece_view(flat[s.param], s) for s in pieces]))


@overload
def shard_update(
    opt: FunctionalOptimizer,
    params: Mapping[str, Tensor],
    grads: Mapping[str, Tensor],
    state: ShardState,
    ownership: OwnershipLike,
    rank: int,
) -> tuple[dict[str, Tensor], ShardState]: ...
@overload
def shard_update(
    opt: FunctionalOptimizer,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    state: ShardState,
    ownership: OwnershipLike,
    rank: int,
) -> tuple[list[Tensor], ShardState]: ...
def shard_update(
    opt: FunctionalOptimizer,
    params: Params,
    grads: Params,
    state: ShardState,
    ownership: OwnershipLike,
    rank: int,
) -> tuple[dict[str, Tensor] | list[Tensor], ShardState]:
    """Pure update of this rank's pieces: a parameter it owns a piece of comes back new with
    the piece updated, the others as the same objects (same container as ``params``).

    Example:
        >>> from zero_functional.functional import adam
        >>> from zero_functional.core.ownership import flat_ownership
        >>> params, opt = {"w": torch.ones(4, 2), "b": torch.zeros(2)}, adam(lr=0.1)
        >>> ownership = flat_ownership([8, 2], world_size=2)  # rank 0: w's first 5 elements
        >>> state = shard_init(opt, params, ownership, rank=0)
        >>> grads = {"w": torch.ones(4, 2), "b": torch.ones(2)}
        >>> new, state = shard_update(opt, params, grads, state, ownership, rank=0)
        >>> [round(v, 4) for v in new["w"].reshape(-1)[4:6].tolist()], new["b"] is params["b"]
        ([0.9, 1.0], True)
    """
    flat_p, flat_g = _as_list(params), _as_list(grads)
    if len(flat_p) != len(flat_g):
        raise ValueError(f"got {len(flat_p)} parameters but {len(flat_g)} gradients")
    pieces = _ownership(ownership, flat_p).owned(rank)
    if pieces != state.pieces:
        raise ValueError(
            f"this state holds pieces {state.pieces} but rank {rank} owns {pieces}: the state "
            "comes from another rank or ownership; call shard_init again"
        )
    updated, inner = opt.update(
        [piece_view(flat_p[s.param], s) for s in pieces],
        [piece_view(flat_g[s.param], s) for s in pieces],
        state.inner,
    )
    new = list(flat_p)
    for s, t in zip(pieces, updated):
        if s.is_whole:
            new[s.param] = t
            continue
        with torch.no_grad():  # a new parameter, the updated piece in place
            new[s.param] = flat_p[s.param].detach().clone()
            new[s.param].view(-1)[s.start : s.stop] = t
    out: dict[str, Tensor] | list[Tensor] = (
        dict(zip(params.keys(), new)) if isinstance(params, Mapping) else new
    )
    return out, ShardState(pieces, inner)
