"""Bulk bytes between chosen ranks, all at once: a snapshot's share to the rank that keeps its copy.

Each rank sends one 1-D ``uint8`` tensor to each rank it names and receives one from each rank it
names; the sizes go first, then the bytes, every send and receive of a round in flight together
(a ring of partners is one round, not one transfer after another as :func:`.exchange_objects`'s
ordered pairs are). Unlike the collectives of the step, these may be issued from a thread of
their own, over a group no other thread uses.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from zero_functional.comm.groups import ProcessGroup, global_rank
from zero_functional.comm.pending import Pending, start_one


def swap_bytes(
    send: Mapping[int, Tensor], receive: Sequence[int], group: ProcessGroup
) -> dict[int, Tensor]:
    """Send ``send[dst]`` (1-D ``uint8``, on the CPU) to each group rank ``dst`` and receive what
    each rank of ``receive`` sends this one; what arrived, by source. Every sender and receiver of
    a message must name each other in the same call.

    Example:
        >>> swap_bytes({}, [], group)
        {}
    """

    def round_(outgoing: Mapping[int, Tensor], incoming: Mapping[int, Tensor]) -> None:
        pending: list[Pending] = []
        for dst, t in outgoing.items():
            issue = functools.partial(dist.isend, t, global_rank(group, dst), group=group)
            pending.append(start_one(issue, [t], group))
        for src, t in incoming.items():
            issue = functools.partial(dist.irecv, t, global_rank(group, src), group=group)
            pending.append(start_one(issue, [t], group))
        for p in pending:
            p.wait()

    sizes = {q: torch.empty(1, dtype=torch.int64) for q in receive}
    round_({d: torch.tensor([t.numel()], dtype=torch.int64) for d, t in send.items()}, sizes)
    out = {q: torch.empty(int(n.item()), dtype=torch.uint8) for q, n in sizes.items()}
    round_(
        {d: t for d, t in send.items() if t.numel()}, {q: t for q, t in out.items() if t.numel()}
    )
    return out
