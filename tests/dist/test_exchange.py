"""The reduce onto owners on gloo (issue 33): all-to-alls at the byte floor, in chunks of a
bounded window; each owner adds the others' values onto its own in rank order."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zero_functional import comm
from zero_functional.comm import exchange

from tests.helpers import all_to_all_sent, run_ranks


def _values(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def _random_runs(seed: int, numel: int, world: int) -> list[tuple[int, int, int]]:
    """Runs covering ``[0, numel)``, owners interleaved, some empty ranks, seeded."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, numel), 6))
    bounds = [0, *cuts, numel]
    return [(a, b, rng.randrange(world)) for a, b in zip(bounds, bounds[1:])]


def _exchange_worker(rank: int, world: int) -> dict[str, Any]:
    sent: list[int] = []
    original = dist.all_to_all_single

    def counted(output: Any, input: Any, out_splits: Any, in_splits: Any, **kw: Any) -> Any:
        sent.append(all_to_all_sent(input, in_splits, kw.get("group")))
        return original(output, input, out_splits, in_splits, **kw)

    reduces: list[int] = []
    original_reduce = dist.reduce

    def reduce(*args: Any, **kw: Any) -> Any:
        reduces.append(1)
        return original_reduce(*args, **kw)

    dist.all_to_all_single, dist.reduce = counted, reduce  # type: ignore[assignment]
    out: dict[str, Any] = {}
    group = dist.group.WORLD
    try:
        numel = 1000
        cases = {
            "even": [(r * numel // world, (r + 1) * numel // world, r) for r in range(world)],
            "interleaved": _random_runs(7, numel, world),
            "one owner": [(0, numel, world - 1)],
        }
        # a window of 64 bytes: 8 to 32 elements per owner per chunk, dozens of chunks, by an
        # exchanger's thread (the rest here, on this thread)
        chunked = {f"{name}, 64-byte window": runs for name, runs in cases.items()}
        exchange.WINDOW_BYTES = 64
        exchanger = comm.Exchanger(group)
        for name, runs in [*cases.items(), *chunked.items()]:
            exchange.WINDOW_BYTES = 64 if "window" in name else 1 << 20
            for dtype in (torch.float32, torch.bfloat16, torch.float64):
                sent.clear()
                buffer = _values(rank, numel, dtype)
                by = exchanger if "window" in name else None
                comm.start_reduce(buffer, runs, group, exchanger=by).wait()
                expected = _values(rank, numel, dtype)  # its own, then the others in rank order
                for r in range(world):
                    if r != rank:
                        expected.add_(_values(r, numel, dtype))
                owned = [(a, b) for a, b, r in runs if r == rank]
                out[f"{name} {dtype}"] = all(
                    torch.equal(buffer[a:b], expected[a:b]) for a, b in owned
                )
                owned_numel = sum(b - a for a, b in owned)
                out[f"{name} {dtype} bytes"] = (
                    sum(sent),
                    (numel - owned_numel) * buffer.element_size(),
                )
        # the windows held: per dtype two received and at most two sent, each within its 64 bytes
        out["windows"] = 0 < exchanger.held_bytes() <= 3 * 4 * 64
        # three exchanges in flight at once (DDP's buckets), chunked: done in the order given
        exchange.WINDOW_BYTES = 256
        runs = cases["interleaved"]
        buffers = [_values(rank + 10 * k, numel, torch.float32) for k in range(3)]
        pendings = [comm.start_reduce(b, runs, group, exchanger=exchanger) for b in buffers]
        for p in pendings:
            p.wait()
        fine = True
        for k, b in enumerate(buffers):
            expected = _values(rank + 10 * k, numel, torch.float32)
            for r in range(world):
                if r != rank:
                    expected.add_(_values(r + 10 * k, numel, torch.float32))
            fine &= all(torch.equal(b[x:y], expected[x:y]) for x, y, r in runs if r == rank)
        out["in flight together"] = fine
        # the functional API: tensors of two dtypes onto their owners, averaged
        tensors = [_values(rank, n, d) for n, d in ((5, torch.float32), (7, torch.float64))]
        tensors += [_values(rank + 9, 3, torch.float32)]
        owners = [world - 1, 0, 1 % world]
        comm.reduce_to_owners(tensors, owners, group)
        fine = True
        for i, (t, owner) in enumerate(zip(tensors, owners)):
            if owner != rank:
                continue
            seeds = [r + (9 if i == 2 else 0) for r in range(world)]
            each = [_values(s, t.numel(), t.dtype) / world for s in seeds]
            # The same W <= 4 values added in another order: at most (W - 1) u sum |x_r| apart (u =
            # 2^-24, |x_r| < 4 for these seeded values), plus a rounding of each x_r / W: at most
            # 9.6e-7 at 4 ranks; float64's are closer still.
            fine &= bool(torch.allclose(t, sum(each), rtol=0, atol=1e-6))
        out["reduce_to_owners"] = fine
        out["gloo reduces"] = len(reduces)
    finally:
        exchange.WINDOW_BYTES = 1 << 20
        dist.all_to_all_single, dist.reduce = original, original_reduce  # type: ignore[assignment]
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_reduce_onto_owners_is_all_to_alls_at_the_byte_floor(world: int) -> None:
    """Each owner's runs hold its values plus the others' in rank order (bitwise, fp32, bf16 and
    fp64, even, interleaved and one-owner runs, in one chunk or dozens); each rank sends exactly
    the elements it does not own, once; the windows stay within their bound; gloo's own reduce
    is never called."""
    for out in run_ranks(_exchange_worker, world, timeout_s=120):
        for key, value in out.items():
            if key.endswith("bytes"):
                assert value[0] == value[1], (key, value)
            elif key == "gloo reduces":
                assert value == 0
            else:
                assert value is True, key


def _after_a_group_of_some_ranks(rank: int, world: int) -> list[float]:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_functional.hooks import reduce_scatter_hook
    from zero_functional.optimizer import ZeroRedundancyOptimizer

    dist.new_group([0])  # a group of rank 0 only: torch counts it among rank 0's groups alone
    torch.manual_seed(0)
    ddp = DDP(nn.Linear(4, 4))
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1, partition="flat")
    ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))  # its exchanger: a twin group
    for _ in range(2):
        ddp(torch.ones(3, 4) * (rank + 1)).sum().backward()
        zero.step()
        zero.zero_grad()
    twin = comm.twin_group(dist.group.WORLD)  # overlap mode's, made the same way
    assert twin is not None
    return [float(p.sum()) for p in ddp.parameters()]


def test_twin_groups_are_made_after_a_group_of_only_some_ranks() -> None:
    # torch names a locally synchronised group from the count of the groups a rank belongs to:
    # after `new_group([0])` the ranks disagreed, and the first bucket's twin group hung
    first, second = run_ranks(_after_a_group_of_some_ranks, 2, timeout_s=60)
    assert first == second
