"""Collectives: the only module of zero_functional that talks to ``torch.distributed``.

Everything here is issued from the calling thread in an order that depends only on values every
rank shares (the partition, the bucket layout), never on timing. That is the rule that keeps gloo
from hanging: gloo matches collectives across ranks by the order they are issued.

Nothing is left to gloo's threads once a collective has been waited for: the tensors a collective
was given stay referenced here until the backend has let go of them (:class:`Pending`), so that
no gloo thread frees a tensor that still has a Python object, which needs the GIL. A gloo thread
that asks for the GIL while the interpreter shuts down ends the process with ``std::terminate``
(SIGABRT, "terminate called without an active exception": issue 20).

The package's modules, each with one job: :mod:`~zero_functional.comm.groups` (sizes, ranks,
backends), :mod:`~zero_functional.comm.calls` (naming and explaining failures),
:mod:`~zero_functional.comm.pending` (collectives in flight),
:mod:`~zero_functional.comm.collectives` (each buffer's reducer and gatherer, chosen once),
:mod:`~zero_functional.comm.buckets` (lists of tensors), :mod:`~zero_functional.comm.exchange`
(gloo's reduce onto owners as all-to-alls in bounded chunks), :mod:`~zero_functional.comm.worker` (a thread that
runs work in order), :mod:`~zero_functional.comm.small` (scalars and objects). Callers
import this package, never the modules.
"""

from __future__ import annotations

# Imported with this package, so before the caller's init_process_group, as torch's own
# ZeroRedundancyOptimizer imports it (through torch.distributed.optim). Its functions bind
# `group=group.WORLD` as default arguments; imported after init_process_group (as it is by the
# first torch.optim.Optimizer built then, through torch._dynamo) they hold the default group
# past destroy_process_group, its gloo threads run on into interpreter shutdown, and one that
# then frees a tensor aborts the process (issue 20). Imported first, the defaults are None.
import torch.distributed.nn.functional  # noqa: F401

from zero_functional.comm.buckets import (
    reduce_to_owners,
    start_all_reduce,
    start_all_reduce_spans,
    start_gather_units,
    start_sync_params,
    sync_params,
    unflatten_into,
)
from zero_functional.comm.calls import REPORT_GRACE_S, CollectiveError, call, failures
from zero_functional.comm.collectives import (
    Gatherer,
    Reducer,
    Wire,
    start_broadcast,
    start_reduce,
)
from zero_functional.comm.exchange import Exchanger
from zero_functional.comm.groups import (
    MESH_DIMS,
    ProcessGroup,
    Work,
    backend,
    collective_device,
    default_group,
    global_rank,
    group_rank,
    group_size,
    is_nccl,
    mesh_groups,
    rank_or_zero,
    sharding_groups,
    twin_group,
)
from zero_functional.comm.pending import SETTLE_S, Pending
from zero_functional.comm.small import (
    all_gather_objects,
    all_gather_scalar,
    all_reduce_scalar,
    any_rank,
    broadcast_object,
    exchange_objects,
    from_bytes,
    gather_objects,
    recv_object,
    send_object,
    to_bytes,
)
from zero_functional.comm.worker import InOrder
from zero_functional.core.plans import COALESCE_BELOW

__all__ = [
    "Exchanger",
    "Gatherer",
    "InOrder",
    "Reducer",
    "Wire",
    "COALESCE_BELOW",
    "CollectiveError",
    "REPORT_GRACE_S",
    "SETTLE_S",
    "Pending",
    "ProcessGroup",
    "Work",
    "all_gather_objects",
    "all_gather_scalar",
    "all_reduce_scalar",
    "any_rank",
    "backend",
    "broadcast_object",
    "call",
    "collective_device",
    "default_group",
    "exchange_objects",
    "from_bytes",
    "failures",
    "gather_objects",
    "global_rank",
    "group_rank",
    "group_size",
    "MESH_DIMS",
    "is_nccl",
    "mesh_groups",
    "rank_or_zero",
    "recv_object",
    "reduce_to_owners",
    "send_object",
    "sharding_groups",
    "start_all_reduce",
    "start_all_reduce_spans",
    "start_broadcast",
    "start_gather_units",
    "start_reduce",
    "start_sync_params",
    "sync_params",
    "to_bytes",
    "twin_group",
    "unflatten_into",
]
