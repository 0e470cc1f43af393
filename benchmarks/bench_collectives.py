"""What each way of moving one step's gradients and parameters costs on this backend, same processes.

Per rank, the gradients of the benchmark model as one flat buffer, moved every way a ZeRO-1 step
can move them, round-robin inside the same gloo ranks so that they share the machine's state:

* ``torch's ZeRO: all-reduce + broadcast per owner``: DDP's all-reduce, then each owner broadcasts
  its updated share (what torch's class sends: 1.5x DDP's bytes); the baseline (1.00x);
* ``DDP: all-reduce``: the gradients alone;
* ``ours: reduce onto owners + broadcast per owner``: each share summed onto its owner through
  ``zero_functional.comm`` (on gloo all-to-alls: :mod:`zero_functional.comm.exchange`), then
  broadcast from it (DDP's bytes, what the optimizer sends on gloo), and each half alone;
* ``reduce_scatter + all_gather (even shares)``: what the policy picks on NCCL, run on this
  backend to show why it is not picked here;
* gloo's own pieces alone: reduce per owner, broadcast per owner, ``all_gather`` into a list,
  ``all_gather_into_tensor``, ``reduce_scatter_tensor``.

Prints the median of the slowest rank and its ratio to torch's ZeRO (below 1 is faster). With
``--link RATE`` the script re-runs on a loopback shaped to RATE (:mod:`zero_functional.app.link`)
and each row also shows its byte floor: the bytes every rank must send for it together (a
reduce-scatter or an all-gather ``(N - 1) S``, an all-reduce twice that), divided by the rate.

    python benchmarks/bench_collectives.py [--world-sizes 2 3 4] [--rounds 15] [--numel 8000000]
        [--link 2gbit]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from _common import add_link_argument, median_ms, mlp, run_ranks
from zero_functional import comm
from zero_functional.app.link import byte_floor_ms, run_shaped

BASELINE = "torch's ZeRO: all-reduce + broadcast per owner"
OURS_REDUCE = "ours: reduce onto owners"
OURS_GATHER = "ours: all-gather (broadcast per owner)"
# each variant's bytes, all ranks together, in (N - 1) S: what its floor is made of
FLOOR_UNITS = {
    BASELINE: 3,
    "DDP: all-reduce": 2,
    "ours: reduce onto owners + broadcast per owner": 2,
    OURS_REDUCE: 1,
    OURS_GATHER: 1,
    "reduce_scatter + all_gather (even shares)": 2,
    "gloo: reduce per owner": 1,
    "gloo: broadcast per owner": 1,
    "all_gather into a list": 1,
    "all_gather_into_tensor": 1,
    "reduce_scatter_tensor": 1,
}


def _ops(flat: torch.Tensor, world_size: int) -> dict[str, Callable[[], None]]:
    share = flat.numel() // world_size
    even = flat[: share * world_size]
    shares = list(even.split(share))
    mine = torch.empty(share)
    group = dist.group.WORLD
    assert group is not None
    runs = [(r * share, (r + 1) * share, r) for r in range(world_size)]

    def each(op: Callable[..., Any]) -> None:
        works = [op(piece, owner, async_op=True) for owner, piece in enumerate(shares)]
        for w in works:
            w.wait()

    def all_reduce() -> None:
        dist.all_reduce(flat)

    def reduce_scatter() -> None:
        dist.reduce_scatter_tensor(mine, even)

    def all_gather_into() -> None:
        dist.all_gather_into_tensor(even, mine)

    def ours_reduce() -> None:
        comm.start_reduce(even, runs, group).wait()

    def ours_gather() -> None:
        comm.start_broadcast(even, runs, group).wait()

    return {
        BASELINE: lambda: (all_reduce(), each(dist.broadcast)),
        "DDP: all-reduce": all_reduce,
        "ours: reduce onto owners + broadcast per owner": lambda: (ours_reduce(), ours_gather()),
        OURS_REDUCE: ours_reduce,
        OURS_GATHER: ours_gather,
        "reduce_scatter + all_gather (even shares)": lambda: (reduce_scatter(), all_gather_into()),
        "gloo: reduce per owner": lambda: each(dist.reduce),
        "gloo: broadcast per owner": lambda: each(dist.broadcast),
        "all_gather into a list": lambda: dist.all_gather(shares, mine),
        "all_gather_into_tensor": all_gather_into,
        "reduce_scatter_tensor": reduce_scatter,
    }


def _worker(rank: int, world_size: int, numel: int, rounds: int) -> dict[str, float]:
    torch.set_num_threads(max(1, 2 // world_size))
    warnings.filterwarnings("ignore", category=FutureWarning)  # reduce_scatter_tensor's rename
    total = sum(p.numel() for p in mlp(numel).parameters())
    flat = torch.randn(total, generator=torch.Generator().manual_seed(rank)) * 1e-3
    ops = _ops(flat, world_size)
    times: dict[str, list[float]] = {name: [] for name in ops}
    for r in range(rounds + 1):
        for name, op in ops.items():
            dist.barrier()
            t0 = time.perf_counter()
            op()
            if r:  # one warm-up round
                times[name].append(time.perf_counter() - t0)
            flat.mul_(1.0 / world_size)  # keep the values bounded round after round
    return {name: median_ms(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--numel", type=int, default=8_000_000)
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    add_link_argument(ap)
    args = ap.parse_args()
    run_shaped(args.link)
    n_params = sum(p.numel() for p in mlp(args.numel).parameters())
    rows = []
    for ws in args.world_sizes:
        results = run_ranks(_worker, ws, args.numel, args.rounds, timeout_s=1800)
        ms = {name: max(r[name] for r in results) for name in results[0]}
        base = ms[BASELINE]
        link = f" on {args.link}" if args.link else ""
        print(
            f"\n== world size {ws}, {n_params:,} fp32 gradients{link}, median of {args.rounds} rounds"
        )
        floor_head = f"{'floor ms':>10}{'x floor':>9}" if args.link else ""
        print(f"{'collectives':<48}{'ms':>8}{'x torch ZeRO':>14}{floor_head}")
        for name, t in ms.items():
            row: dict[str, Any] = {
                "benchmark": f"collectives ({n_params / 1e6:.0f}M fp32{link})",
                "world_size": ws,
                "variant": name,
                "ms": t,
                "vs_torch_best": t / base,
            }
            floor_cols = ""
            if args.link:
                floor = byte_floor_ms(FLOOR_UNITS[name] * (ws - 1) * n_params * 4, args.link)
                row.update(floor_ms=floor, vs_floor=t / floor)
                floor_cols = f"{floor:>10.1f}{t / floor:>8.2f}x"
            print(f"{name:<48}{t:>8.1f}{t / base:>13.2f}x{floor_cols}")
            rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
