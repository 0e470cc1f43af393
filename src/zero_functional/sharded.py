"""The functional ZeRO step for custom training loops (``torch.func`` and friends).

No stateful shell: given a partition (which rank owns which parameter), this rank and a
functional optimizer, :func:`shard_init` builds state for the owned parameters only and
:func:`shard_update` updates them purely; then :func:`zero_functional.comm.sync_params` (the one
collective) makes every rank hold every owner's parameters.

Example:
    >>> import torch
    >>> from zero_functional.functional import adam
    >>> from zero_functional.partition import sorted_greedy
    >>> params = {"w": torch.ones(4, 2), "b": torch.zeros(2)}
    >>> partition = sorted_greedy([p.numel() for p in params.values()], world_size=2)
    >>> opt = adam(lr=0.1)
    >>> state = shard_init(opt, params, partition, rank=0)
    >>> grads = {"w": torch.ones(4, 2), "b": torch.ones(2)}
    >>> new_params, state = shard_update(opt, params, grads, state, partition, rank=0)
    >>> new_params["w"][0, 0].item() < 1.0, new_params["b"].eq(0).all().item()  # rank 0 owns "w"
    (True, True)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, overload

from torch import Tensor

from zero_functional.functional import FunctionalOptimizer, State

__all__ = ["ShardState", "owned_indices", "shard_init", "shard_update", "shard_owners"]

Params = Mapping[str, Tensor] | Sequence[Tensor]


class ShardState(NamedTuple):
    """Optimizer state of this rank's parameters: ``indices`` into the parameter list."""

    indices: tuple[int, ...]
    inner: State


def owned_indices(partition: Sequence[Sequence[int]], rank: int) -> tuple[int, ...]:
    """The parameter indices ``rank`` owns under ``partition``, in ascending order.

    Example:
        >>> owned_indices(((2, 0), (1,)), rank=0)
        (0, 2)
    """
    if not 0 <= rank < len(partition):
        raise ValueError(f"rank {rank} is not in a partition over {len(partition)} ranks")
    return tuple(sorted(partition[rank]))


def shard_owners(partition: Sequence[Sequence[int]], num_params: int) -> list[int]:
    """For each parameter index, the rank that owns it (what ``comm.sync_params`` takes).

    Example:
        >>> shard_owners(((2, 0), (1,)), 3)
        [0, 1, 0]
    """
    owner = [-1] * num_params
    for r, indices in enumerate(partition):
        for i in indices:
            if not 0 <= i < num_params or owner[i] != -1:
                raise ValueError(f"parameter index {i} is out of range or owned twice")
            owner[i] = r
    if -1 in owner:
        raise ValueError(f"parameter {owner.index(-1)} has no owner in the partition")
    return owner


def _as_list(params: Params) -> list[Tensor]:
    return list(params.values()) if isinstance(params, Mapping) else list(params)


def shard_init(
    opt: FunctionalOptimizer, params: Params, partition: Sequence[Sequence[int]], rank: int
) -> ShardState:
    """State for the parameters ``rank`` owns, and nothing for the others.

    Args:
        opt: A functional optimizer (``zero_functional.functional.adam(...)`` etc.).
        params: All parameters, as a list or a ``{name: tensor}`` dict (model order).
        partition: Per rank the parameter indices it owns (``sorted_greedy``'s result).
        rank: This rank.
    """
    flat = _as_list(params)
    shard_owners(partition, len(flat))
    indices = owned_indices(partition, rank)
    return ShardState(indices, opt.init([flat[i] for i in indices]))


@overload
def shard_update(
    opt: FunctionalOptimizer,
    params: Mapping[str, Tensor],
    grads: Mapping[str, Tensor],
    state: ShardState,
    partition: Sequence[Sequence[int]],
    rank: int,
) -> tuple[dict[str, Tensor], ShardState]: ...
@overload
def shard_update(
    opt: FunctionalOptimizer,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    state: ShardState,
    partition: Sequence[Sequence[int]],
    rank: int,
) -> tuple[list[Tensor], ShardState]: ...
def shard_update(
    opt: FunctionalOptimizer,
    params: Params,
    grads: Params,
    state: ShardState,
    partition: Sequence[Sequence[int]],
    rank: int,
) -> tuple[dict[str, Tensor] | list[Tensor], ShardState]:
    """Pure update of this rank's parameters; the others come back as they were.

    Never mutates an argument. Follow it with ``comm.sync_params`` on the new parameters (after
    copying them into the model, or on the tensors themselves) to give every rank every shard.

    Returns:
        The new parameters (same container kind as ``params``) and the new shard state.
    """
    flat_p, flat_g = _as_list(params), _as_list(grads)
    if len(flat_p) != len(flat_g):
        raise ValueError(f"got {len(flat_p)} parameters but {len(flat_g)} gradients")
    indices = owned_indices(partition, rank)
    if indices != state.indices:
        raise ValueError(
            f"this state holds parameters {state.indices} but rank {rank} owns {indices}: "
            "the state comes from another rank or partition; call shard_init again"
        )
    updated, inner = opt.update(
        [flat_p[i] for i in indices], [flat_g[i] for i in indices], state.inner
    )
    new = list(flat_p)
    for i, t in zip(indices, updated):
        new[i] = t
    out: dict[str, Tensor] | list[Tensor] = (
        dict(zip(params.keys(), new)) if isinstance(params, Mapping) else new
    )
    return out, ShardState(indices, inner)
