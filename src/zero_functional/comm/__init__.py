"""Collectives: the only package of zero_functional that talks to ``torch.distributed``.

Two rules hold for every collective here; the rest of the package points to them:

* **Issue order.** gloo pairs collectives across ranks by the order they are issued, so each
  goes out from the calling thread in an order that depends only on values every rank shares
  (the ownership, the bucket layout), never on timing.
* **Nothing left to gloo's threads.** A gloo thread lets go of a collective's tensors just after
  marking it complete. Had their Python objects gone first, the thread would free them, which
  needs the GIL; asked for while the interpreter shuts down, that ends the process with
  ``std::terminate``. So the tensors stay referenced until the backend has let go
  (:class:`Pending`).

Callers import this package, never its modules."""

from __future__ import annotations

# Imported with this package, before the caller's init_process_group, as torch's own
# ZeroRedundancyOptimizer imports it. Imported after, its functions' `group=group.WORLD`
# defaults hold the default group past destroy_process_group, and its gloo threads run on
# into interpreter shutdown (the second rule above). Imported first, the defaults are None.
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
from zero_functional.comm.bulk import swap_bytes
from zero_functional.comm.calls import CollectiveError, call, failures
from zero_functional.comm.codec import WIRE_DTYPES, WIRE_NAMES, Codec, check_wire_dtype
from zero_functional.comm.collectives import Wire, start_broadcast, start_reduce
from zero_functional.comm.exchange import Exchanger
from zero_functional.comm.groups import (
    ProcessGroup,
    backend,
    collective_device,
    default_group,
    global_rank,
    group_rank,
    group_size,
    host_group,
    is_nccl,
    rank_or_zero,
    sharding_groups,
    twin_group,
)
from zero_functional.comm.pending import Pending
from zero_functional.comm.small import (
    all_gather_objects,
    all_gather_scalar,
    all_reduce_scalar,
    any_rank,
    broadcast_object,
    bytes_of,
    exchange_objects,
    from_bytes,
    gather_objects,
    recv_object,
    to_bytes,
)
from zero_functional.comm.worker import InOrder
from zero_functional.core.plans import COALESCE_BELOW

__all__ = [
    "COALESCE_BELOW",
    "Codec",
    "CollectiveError",
    "Exchanger",
    "InOrder",
    "Pending",
    "ProcessGroup",
    "WIRE_DTYPES",
    "WIRE_NAMES",
    "Wire",
    "all_gather_objects",
    "all_gather_scalar",
    "all_reduce_scalar",
    "any_rank",
    "backend",
    "broadcast_object",
    "bytes_of",
    "call",
    "check_wire_dtype",
    "collective_device",
    "default_group",
    "exchange_objects",
    "failures",
    "from_bytes",
    "gather_objects",
    "global_rank",
    "group_rank",
    "group_size",
    "host_group",
    "is_nccl",
    "rank_or_zero",
    "recv_object",
    "reduce_to_owners",
    "sharding_groups",
    "start_all_reduce",
    "start_all_reduce_spans",
    "start_broadcast",
    "start_gather_units",
    "start_reduce",
    "start_sync_params",
    "swap_bytes",
    "sync_params",
    "to_bytes",
    "twin_group",
    "unflatten_into",
]
