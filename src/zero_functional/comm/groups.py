"""Process groups: sizes, ranks, backends and devices, asked of ``torch.distributed`` here."""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch.futures import Future

ProcessGroup = dist.ProcessGroup
MESH_DIMS = ("replicate", "shard")  # a hybrid-sharding mesh's dimensions, as FSDP2 names them


class Work(Protocol):
    """The handle an asynchronous collective returns."""

    def wait(self, timeout: timedelta = ...) -> bool: ...

    def get_future(self) -> Future[object]: ...

    def is_completed(self) -> bool: ...


def default_group(group: ProcessGroup | None) -> ProcessGroup:
    """``group``, or the default (world) group when it is ``None``."""
    if group is not None:
        return group
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call "
            "torch.distributed.init_process_group(...) before building a ZeroRedundancyOptimizer "
            "(with the Hugging Face Trainer, build it after TrainingArguments(...), which "
            "initializes the process group)"
        )
    return cast(ProcessGroup, dist.group.WORLD)  # initialized: never None


def group_size(group: ProcessGroup) -> int:
    """Number of ranks in ``group``."""
    return int(dist.get_world_size(group))


def group_rank(group: ProcessGroup) -> int:
    """This process's rank within ``group``."""
    return int(dist.get_rank(group))


def global_rank(group: ProcessGroup, rank: int) -> int:
    """The global rank of ``rank`` of ``group`` (collectives take global ranks as sources)."""
    return int(dist.get_global_rank(group, rank))


def collective_device(group: ProcessGroup, fallback: torch.device) -> torch.device:
    """The device object messages travel on: CUDA for NCCL (device tensors only), else the CPU."""
    if "nccl" not in backend(group).lower():  # not is_nccl, which tests fake for the launches
        return torch.device("cpu")
    if fallback.type == "cuda":
        return fallback
    return torch.device("cuda", torch.cuda.current_device())


def rank_or_zero(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the world), or 0 without a process group.

    Example:
        >>> rank_or_zero()  # no process group in this process
        0
    """
    return int(dist.get_rank(group)) if dist.is_initialized() else 0


def twin_group(group: ProcessGroup) -> ProcessGroup | None:
    """A second process group over ``group``'s ranks (collective over them), or ``None`` on a
    torch without local synchronisation of new groups: its collectives are ordered among themselves
    only, so the all-gathers go out when ready without breaking the reductions' issue order."""
    return _twin(group, None)


def host_group(group: ProcessGroup) -> ProcessGroup | None:
    """A gloo twin of ``group`` (as :func:`twin_group`) for host bytes a thread of its own sends
    beside the training's collectives, whatever their backend (a snapshot's share beside NCCL).

    Example:
        >>> backend(host_group(group))
        'gloo'
    """
    return _twin(group, "gloo")


def _twin(group: ProcessGroup, backend: str | None) -> ProcessGroup | None:
    ranks = [global_rank(group, r) for r in range(group_size(group))]
    if len(ranks) == dist.get_world_size():
        # Over the whole world, a plain new_group: with local synchronization torch names the
        # group from the count of groups this rank is in, which differs between ranks once a
        # group of only some was made, and they would wait under different names for ever.
        return cast(ProcessGroup, dist.new_group(ranks=ranks, backend=backend))
    try:
        twin = dist.new_group(ranks=ranks, backend=backend, use_local_synchronization=True)
    except TypeError:  # torch < 2.1: new_group would need every rank of the world
        return None
    return cast(ProcessGroup | None, twin)


def backend(group: ProcessGroup) -> str:
    """The name of ``group``'s backend (``"gloo"``, ``"nccl"``, ...)."""
    return str(dist.get_backend(group))


def is_nccl(group: ProcessGroup) -> bool:
    """Whether ``group`` runs on NCCL (whose collectives can be grouped into one launch)."""
    return "nccl" in backend(group).lower()


def sharding_groups(
    process_group: ProcessGroup | None, mesh: object
) -> tuple[ProcessGroup | None, ProcessGroup | None]:
    """The groups to shard and to replicate over, from a ``process_group`` or a 2-D ``mesh``.

    Example:
        >>> sharding_groups(None, None)
        (None, None)
        >>> sharding_groups(None, "2x2")
        Traceback (most recent call last):
        ...
        TypeError: device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got str
    """
    if mesh is None:
        return process_group, None
    if process_group is not None:
        raise ValueError(
            "pass device_mesh (2-D: shard within, replicate across) or process_group (1-D), "
            "not both"
        )
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            "device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
            f"{type(mesh).__name__}"
        )
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or names != MESH_DIMS:
        raise ValueError(
            f"device_mesh must be 2-D with mesh_dim_names={MESH_DIMS} (FSDP2's names: state "
            f"sharded over 'shard', replicated over 'replicate'); got {mesh.ndim}-D {names}: "
            'build it with init_device_mesh(device, (R, S), mesh_dim_names=("replicate", '
            '"shard"))'
        )
    return mesh.get_group("shard"), mesh.get_group("replicate")
