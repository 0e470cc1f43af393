"""Whole DDP iterations (forward, backward, step) of an 8M-parameter MLP, five ways, same processes.

1. DDP + plain fused Adam (every rank holds all state);
2. DDP + torch's ZeroRedundancyOptimizer at its best (bucket views, fused Adam);
3. DDP + ours, step after backward;
4. DDP + ours in overlap mode (hook_with_zero_step_interleaved), all-reduce + broadcasts;
5. the same with reduce + broadcasts (each owner's piece reduced onto its owner).
(torch's own overlap mode refuses gloo, pytorch#62300, so it cannot be measured here.)
Variants run round-robin inside the same gloo ranks. Prints median iteration time, ratios against
the plain fused-Adam baseline and against torch's best ZeRO, and the bytes each rank sends per
iteration under ring collectives: an all-reduce of S bytes sends 2(n-1)/n S per rank, a reduce
or a broadcast (S summed over the pieces) (n-1)/n S.

    python benchmarks/bench_overlap.py [--world-sizes 2 4] [--rounds 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

from zero_functional.hooks import hook_with_zero_step_interleaved
from zero_functional.launch import run_ranks
from zero_functional.optimizer import ZeroRedundancyOptimizer

NAMES = [
    "ddp + fused adam",
    "torch zero best",
    "ours",
    "ours overlap allreduce",
    "ours overlap reduce",
]


def _mlp(numel: int) -> nn.Module:
    width = 1000
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(max(1, numel // (width * width))):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def _build(name: str, numel: int, cap_mb: float | None = None) -> tuple[DDP, Any]:
    # cap_mb None keeps DDP's defaults: 25 MB buckets after a small (1 MB) first one, which an
    # explicit bucket_cap_mb turns off
    ddp = DDP(_mlp(numel), bucket_cap_mb=cap_mb)
    if name == "ddp + fused adam":
        return ddp, torch.optim.Adam(ddp.parameters(), lr=1e-4, fused=True)
    if name == "torch zero best":
        return ddp, TorchZero(
            ddp.parameters(), torch.optim.Adam, lr=1e-4, parameters_as_bucket_view=True, fused=True
        )
    if name == "ours":
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-4)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.Adam, lr=1e-4, overlap_with_ddp=True
    )
    collectives = "reduce+broadcast" if name == "ours overlap reduce" else "allreduce+broadcast"
    hook = hook_with_zero_step_interleaved(
        allreduce_hook, ddp, zero, shard_buckets=True, collectives=collectives
    )
    ddp.register_comm_hook(None, hook)
    return ddp, zero


def bytes_sent(name: str, model_bytes: int, world_size: int) -> float:
    """Bytes one rank sends per iteration (ring collectives, averaged over ranks).

    DDP all-reduces the gradients: 2(n-1)/n S. The ZeRO variants without reduce-onto-owners add
    the broadcast of every shard, (n-1)/n S: 1.5x DDP (pytorch#69591). Reduce + broadcast sends
    (n-1)/n S for each: DDP's bytes.
    """
    share = (world_size - 1) / world_size * model_bytes
    if name in ("ddp + fused adam", "ours overlap reduce"):
        return 2 * share
    return 3 * share


def _worker(
    rank: int, world_size: int, numel: int, rounds: int, cap_mb: float | None
) -> dict[str, float]:
    torch.set_num_threads(max(1, 2 // world_size))
    variants = {name: _build(name, numel, cap_mb) for name in NAMES}
    x = torch.randn(32, 1000, generator=torch.Generator().manual_seed(rank))
    times: dict[str, list[float]] = {name: [] for name in NAMES}
    for r in range(rounds + 2):
        for name, (ddp, opt) in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            ddp(x).square().mean().backward()
            if not name.startswith("ours overlap"):
                opt.step()
            if r >= 2:  # two warm-up rounds for every variant alike
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--numel", type=int, default=8_000_000)
    ap.add_argument(
        "--bucket-cap-mb", type=float, help="DDP's, for every variant (default: DDP's own)"
    )
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    args = ap.parse_args()
    model = _mlp(args.numel)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    rows = []
    for ws in args.world_sizes:
        results = run_ranks(
            _worker, ws, args.numel, args.rounds, args.bucket_cap_mb, timeout_s=1800
        )
        med = {name: max(r[name] for r in results) for name in NAMES}  # the slowest rank
        print(f"\n== world size {ws}, {sum(p.numel() for p in model.parameters()):,} parameters")
        print(
            f"{'variant':<24}{'iter ms':>10}{'vs ddp+fused':>14}{'vs torch zero':>15}"
            f"{'MB sent/rank':>14}"
        )
        for name in NAMES:
            mb = bytes_sent(name, model_bytes, ws) / 1e6
            print(
                f"{name:<24}{med[name] * 1e3:>10.1f}{med['ddp + fused adam'] / med[name]:>13.2f}x"
                f"{med['torch zero best'] / med[name]:>14.2f}x{mb:>14.1f}"
            )
            rows.append(
                {
                    "benchmark": f"iteration ({n_params / 1e6:.0f}M MLP)",
                    "world_size": ws,
                    "variant": name,
                    "ms": med[name] * 1e3,
                    "vs_torch_best": med["torch zero best"] / med[name],
                    "mb_sent": mb,
                }
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
