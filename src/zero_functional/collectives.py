"""Which collectives move gradients and parameters, and what they cost (pure policy).

ZeRO-1 needs two movements per iteration: each rank must receive the reduced gradients of
what it owns (a reduce-scatter), and every rank must receive every owner's updated parameters
(an all-gather). Together they send the bytes of one all-reduce: plain DDP's traffic. Three
ways to do it, chosen by :func:`choose_collectives` from values every rank shares:

* ``"reduce_scatter+all_gather"``: ``reduce_scatter_single`` / ``all_gather_single`` over
  even, padded shards (NCCL's fastest path; needs the flat partition's even split);
* ``"reduce+broadcast"``: one reduce and one broadcast per owner's stretch (uneven shards;
  on NCCL these are grouped into one launch, which is how NCCL builds its own uneven
  reduce-scatter and all-gather; on gloo, whose reduce-scatter is an all-reduce in disguise,
  the fastest measured);
* ``"allreduce+broadcast"``: the user's hook reduces every gradient everywhere (compression
  hooks keep their own reduction), then owners broadcast: 1.5x DDP's bytes (pytorch#69591).

Example:
    >>> choose_collectives("nccl", 8, even=True)
    'reduce_scatter+all_gather'
    >>> choose_collectives("gloo", 8, even=True)
    'reduce+broadcast'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from zero_functional._validate import check_world_size
from zero_functional.ownership import Ownership, Run

__all__ = [
    "COLLECTIVES",
    "Collectives",
    "bytes_sent",
    "choose_collectives",
    "choose_param_gather",
    "even_chunk",
]

Collectives = Literal["allreduce+broadcast", "reduce+broadcast", "reduce_scatter+all_gather"]
COLLECTIVES: tuple[Collectives, ...] = (
    "allreduce+broadcast",
    "reduce+broadcast",
    "reduce_scatter+all_gather",
)


def choose_collectives(
    backend: str, world_size: int, hook_is_allreduce: bool = True, *, even: bool = False
) -> Collectives:
    """The collectives for one buffer of gradients and parameters (a pure policy).

    The rule: a hook other than DDP's default all-reduce keeps its own reduction, and so does
    a single rank (nothing is sent); else even shards on NCCL take NCCL's reduce-scatter and
    all-gather; everything else takes one reduce and one broadcast per owner: DDP's bytes.
    On gloo that is the fastest way to send them (``benchmarks/bench_collectives.py``, 32 MB
    on 2 CPU cores, x torch's all-reduce + broadcast: 1.09/1.13/0.86 at 2/3/4 ranks, where
    gloo's reduce-scatter + all-gather takes 2.04-2.59), though at 2 and 3 ranks plain
    all-reduce + broadcast, with 1.5x the bytes, is faster still.

    Args:
        backend: A ``torch.distributed`` backend name.
        world_size: Ranks in the process group.
        hook_is_allreduce: Whether the DDP hook being replaced is the default all-reduce.
        even: Whether the ownership splits the buffer into even shards (``partition="flat"``).

    Returns:
        The strategy name.

    Raises:
        ValueError: An empty backend name or ``world_size < 1``.

    Example:
        >>> choose_collectives("nccl", 8)
        'reduce+broadcast'
        >>> choose_collectives("nccl", 8, hook_is_allreduce=False, even=True)
        'allreduce+broadcast'
        >>> choose_collectives("gloo", 1)
        'allreduce+broadcast'
    """
    if not backend:
        raise ValueError("backend must be a non-empty backend name such as 'gloo' or 'nccl'")
    check_world_size(world_size)
    if not hook_is_allreduce or world_size == 1:
        return "allreduce+broadcast"
    if even and "nccl" in backend.lower():
        return "reduce_scatter+all_gather"
    return "reduce+broadcast"


def choose_param_gather(overlap_with_ddp: bool) -> bool:
    """Whether the parameter all-gather may finish during the next forward by default: never.

    A drop-in keeps torch's observable behaviour at its defaults: parameters are final when
    ``step()`` returns, and in overlap mode when the backward that ran the step returns (torch's
    hook waits for every broadcast at the last bucket). torch's own overlap tests, and user code
    that saves ``model.state_dict()``, reads a tied weight or compares ranks after backward,
    read them then. ``overlap_param_gather=True`` is the opt-in speed (measured in
    ``benchmarks/bench_iteration.py``: 0.88-1.00x instead of 1.06-1.12x torch's best after
    backward at 2-4 ranks on gloo), safe as :mod:`zero_functional.param_sync` describes.

    Example:
        >>> choose_param_gather(overlap_with_ddp=True), choose_param_gather(overlap_with_ddp=False)
        (False, False)
    """
    return False


def even_chunk(runs: Sequence[tuple[int, int, int]], total: int, world_size: int) -> int | None:
    """The shard size if ``runs`` are the even split of ``total`` elements, else ``None``.

    Even means rank ``r`` owns ``[r * chunk, (r + 1) * chunk)`` clipped to ``total`` (ranks
    past the end own nothing): the layout ``reduce_scatter_single`` and ``all_gather_single``
    take, once the buffer is padded to ``chunk * world_size``.

    Args:
        runs: ``(start, stop, rank)`` stretches covering ``[0, total)`` in order.
        total: Elements in the buffer.
        world_size: Ranks.

    Example:
        >>> even_chunk([(0, 4, 0), (4, 7, 1)], 7, 2)
        4
        >>> even_chunk([(0, 3, 0), (3, 7, 1)], 7, 2) is None
        True
    """
    check_world_size(world_size)
    by_rank: dict[int, tuple[int, int]] = {}
    for a, b, rank in runs:
        if rank in by_rank:
            return None
        by_rank[rank] = (a, b)
    first = by_rank.get(0)
    if total == 0 or first is None or first[0] != 0:
        return None
    chunk = first[1]
    expected = {
        r: (r * chunk, min((r + 1) * chunk, total)) for r in range(world_size) if r * chunk < total
    }
    return chunk if by_rank == expected else None


def buffer_runs(
    ownership: Ownership, order: Sequence[int], *, even: bool
) -> tuple[tuple[Run, ...], int | None]:
    """The runs of a buffer holding the parameters ``order`` end to end, and its even shard.

    The one plan of every bucket this package sends (bucket views, DDP buckets in overlap
    mode and under :func:`~zero_functional.hooks.reduce_scatter_hook`): who owns which
    stretch (:meth:`~zero_functional.ownership.Ownership.runs`), and the shard size for
    ``reduce_scatter_single`` / ``all_gather_single`` when ``even`` (the strategy takes even
    shards: ``"reduce_scatter+all_gather"``) and the runs are the even split (else ``None``).

    Example:
        >>> from zero_functional.ownership import flat_ownership
        >>> o = flat_ownership([4, 3], 2)
        >>> buffer_runs(o, [0, 1], even=True)
        ((Run(start=0, stop=4, rank=0), Run(start=4, stop=7, rank=1)), 4)
        >>> buffer_runs(o, [0, 1], even=False)[1] is None
        True
    """
    runs = ownership.runs(order)
    if not even:
        return runs, None
    total = sum(ownership.numels[k] for k in order)
    return runs, even_chunk(runs, total, ownership.world_size)


def bytes_sent(op: str, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends for one collective over ``nbytes``, under ring algorithms.

    An all-reduce sends ``2 (n - 1) / n`` of the buffer per rank; a reduce-scatter, an
    all-gather, and a reduce or broadcast pipelined along a ring ``(n - 1) / n``. So ZeRO's
    reduce-scatter + all-gather costs exactly one all-reduce: DDP's bytes.

    Args:
        op: ``"all_reduce"``, ``"reduce"``, ``"broadcast"``, ``"reduce_scatter"`` or
            ``"all_gather"``.
        nbytes: Bytes of the whole buffer the collective covers.
        world_size: Ranks.

    Example:
        >>> bytes_sent("all_reduce", 100, 4), bytes_sent("reduce", 100, 4)
        (150.0, 75.0)
    """
    check_world_size(world_size)
    share = (world_size - 1) / world_size * nbytes
    if op == "all_reduce":
        return 2 * share
    if op in ("reduce", "broadcast", "reduce_scatter", "all_gather"):
        return share
    raise ValueError(
        f"unknown collective {op!r}: pass all_reduce, reduce, broadcast, reduce_scatter or "
        "all_gather"
    )
