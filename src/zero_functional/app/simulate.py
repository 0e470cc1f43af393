"""``zero-functional plan --simulate``: build the optimizer as chosen ranks of a large world would.

Each simulated rank runs under :func:`zero_functional.comm.testing.fake_world` (torch's fake process
group): the ``ZeroRedundancyOptimizer`` is built over real CPU tensors of the model's shapes, as
that rank of that world would build it, and takes one ``step()`` with zero gradients, so its
state exists. What it holds (pieces, elements, state bytes) is then this package's own code at
that world size, not a formula; the values of a step under the fake group are not meaningful
(nothing is summed), the sizes are.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from zero_functional.app.models import Shape

__all__ = [
    "MAX_SIMULATE_BYTES",
    "SimulatedRank",
    "format_simulated",
    "model_params",
    "simulate",
    "simulate_ranks",
]

MAX_SIMULATE_BYTES = 16 << 30
"""Most bytes of parameters and gradients ``--simulate`` allocates (a 2-billion-parameter
model in fp32): every simulated rank shares one set, but it is real memory."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class SimulatedRank:
    """What one rank of a simulated world holds after one ``step()``.

    Attributes:
        world_size: The simulated world.
        rank: This rank, in the world.
        partition: ``"flat"`` or ``"sorted_greedy"``.
        shard_size: The shard group's size (``world_size`` without hybrid sharding).
        pieces: Parameter pieces this rank owns (whole tensors under sorted-greedy).
        elements: Elements it owns.
        state_bytes: Bytes of the tensors in its optimizer state (and main copies), after the
            step: AdamW's 2 moments per owned element and a step count per piece.
        seconds: Construction and the step, under the fake group.
    """

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


def _state_bytes(zero: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in zero.state.values()
        for v in s.values()
        if isinstance(v, Tensor)
    )


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
    would, step once, and report what it holds.

    With ``shard_size``, the optimizer takes a ``(world_size / shard_size) x shard_size``
    device mesh: the rank owns its share of its shard group. ``params`` may be shared between
    calls: a step changes only the pieces the simulated rank owns. (No doctest: it starts a
    fake world of its own; ``plan --simulate`` in ``tests/test_cli.py`` runs it.)
    """
    from zero_functional.comm.testing import fake_world
    from zero_functional.core.loads import hybrid_shape
    from zero_functional.optimizer import ZeroRedundancyOptimizer

    started = time.perf_counter()
    with fake_world(world_size, rank):
        mesh = None
        if shard_size is not None:
            from torch.distributed.device_mesh import init_device_mesh

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
        result = SimulatedRank(
            world_size=world_size,
            rank=rank,
            partition=partition,
            shard_size=zero.world_size,
            pieces=len(owned),
            elements=sum(s.stop - s.start for s in owned),
            state_bytes=_state_bytes(zero),
            seconds=time.perf_counter() - started,
        )
    return result


def simulate_ranks(
    params: Sequence[nn.Parameter],
    world_sizes: Sequence[int],
    ranks: Sequence[int],
    shard_size: int | None = None,
    main_params: bool = False,
) -> list[SimulatedRank]:
    """:func:`simulate` for each world size, rank and partition (sorted-greedy, then flat)."""
    return [
        simulate(params, w, r, partition=partition, shard_size=shard_size, main_params=main_params)
        for w in world_sizes
        for r in ranks
        for partition in ("sorted_greedy", "flat")
    ]


def format_simulated(rows: Sequence[SimulatedRank]) -> str:
    """One table of simulated ranks.

    Example:
        >>> print(format_simulated([SimulatedRank(1024, 1023, "flat", 8, 2, 520, 4168, 0.01)]))
        simulated ranks (torch's fake process group; AdamW, one step() with zero gradients)
        world   rank  shard of  partition      pieces  owned elements  state bytes   seconds
         1024   1023         8  flat                2             520      4.1 KiB      0.01
    """
    from zero_functional.app.train import format_bytes

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
