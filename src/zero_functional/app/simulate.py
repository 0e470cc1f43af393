"""``zero-functional plan --simulate``: build the optimizer as chosen ranks of a large world would.

Under :func:`~zero_functional.comm.testing.fake_world` (torch's fake process group) each rank
builds the ``ZeroRedundancyOptimizer`` over real tensors of the model's shapes and steps once
with zero gradients: what it then holds is this package's own code at that world size, not a
formula (the values mean nothing, nothing is summed; the sizes do).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from zero_functional.app.models import Shape
from zero_functional.app.plan_format import format_bytes
from zero_functional.comm.testing import fake_world
from zero_functional.core.loads import hybrid_shape
from zero_functional.optimizer import ZeroRedundancyOptimizer

MAX_SIMULATE_BYTES = 16 << 30  # of parameters and gradients (2B fp32 parameters), shared by all

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class SimulatedRank:
    """What one rank of a simulated world holds after one ``step()``: the pieces and elements
    it owns, the bytes of its optimizer state's tensors, and the seconds construction and the
    step took (``shard_size``: its shard group's, ``world_size`` without hybrid sharding)."""

    world_size: int
    rank: int
    partition: str
    shard_size: int
    pieces: int
    elements: int
    state_bytes: int
    seconds: float


def model_params(shapes: Sequence[Shape], dtype: str = "fp32") -> list[nn.Parameter]:
    """Zero parameters of these shapes, each with a zero gradient (what a step needs).

    Raises:
        ValueError: They would take more than :data:`MAX_SIMULATE_BYTES`.
    """
    torch_dtype = DTYPES[dtype]
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    nbytes = 2 * numel * torch_dtype.itemsize
    if nbytes > MAX_SIMULATE_BYTES:
        raise ValueError(
            f"--simulate builds the model's parameters and gradients in memory, "
            f"{nbytes / 2**30:.1f} GiB here, at most {MAX_SIMULATE_BYTES / 2**30:.0f} GiB: "
            "simulate a smaller model (plan without --simulate is pure arithmetic)"
        )
    params = [nn.Parameter(torch.zeros(s, dtype=torch_dtype)) for s in shapes]
    for p in params:
        p.grad = torch.zeros_like(p)
    return params


def simulate(
    params: Sequence[nn.Parameter],
    world_size: int,
    rank: int,
    *,
    partition: str = "flat",
    shard_size: int | None = None,
    main_params: bool = False,
) -> SimulatedRank:
    """Build AdamW's ``ZeroRedundancyOptimizer`` over ``params`` as ``rank`` of ``world_size``
    would (on a ``(world_size / shard_size) x shard_size`` mesh with ``shard_size``), step once,
    and report what it holds. ``params`` may be shared between calls. (No doctest: it starts a
    fake world of its own; ``plan --simulate`` in ``tests/unit/test_cli.py`` runs it.)"""
    started = time.perf_counter()
    with fake_world(world_size, rank):
        mesh = None
        if shard_size is not None:
            shape = hybrid_shape(world_size, shard_size)
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        zero = ZeroRedundancyOptimizer(
            list(params),
            torch.optim.AdamW,
            partition=partition,  # type: ignore[arg-type]
            device_mesh=mesh,
            main_params_dtype=torch.float32 if main_params else None,
        )
        zero.step()
        owned = zero.ownership.owned(zero.rank)
        state = [v for s in zero.state.values() for v in s.values() if isinstance(v, Tensor)]
        return SimulatedRank(
            world_size=world_size,
            rank=rank,
            partition=partition,
            shard_size=zero.world_size,
            pieces=len(owned),
            elements=sum(s.stop - s.start for s in owned),
            state_bytes=sum(v.nbytes for v in state),
            seconds=time.perf_counter() - started,
        )


def format_simulated(rows: Sequence[SimulatedRank]) -> str:
    """One table of simulated ranks.

    Example:
        >>> print(format_simulated([SimulatedRank(1024, 1023, "flat", 8, 2, 520, 4168, 0.01)]))
        simulated ranks (torch's fake process group; AdamW, one step() with zero gradients)
        world   rank  shard of  partition      pieces  owned elements  state bytes   seconds
         1024   1023         8  flat                2             520      4.1 KiB      0.01
    """
    lines = [
        "simulated ranks (torch's fake process group; AdamW, one step() with zero gradients)",
        f"{'world':>5}  {'rank':>5}  {'shard of':>8}  {'partition':<13}  {'pieces':>6}  "
        f"{'owned elements':>14}  {'state bytes':>11}  {'seconds':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r.world_size:>5}  {r.rank:>5}  {r.shard_size:>8}  "
            f"{r.partition.replace('_', '-'):<13}  {r.pieces:>6}  {r.elements:>14,}  "
            f"{format_bytes(r.state_bytes):>11}  {r.seconds:>8.2f}"
        )
    return "\n".join(lines)
