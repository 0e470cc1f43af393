"""Whole DDP iterations (forward, backward, step) of an 8M-parameter MLP, four ways, same processes.

1. DDP + plain fused Adam (every rank holds all state);
2. DDP + torch's ZeroRedundancyOptimizer at its best (bucket views, fused Adam);
3. DDP + ours, step after backward;
4. DDP + ours in overlap mode (the step inside backward, hook_with_zero_step_interleaved).
Variants run round-robin inside the same gloo ranks. Prints median iteration time, ratios against
the plain fused-Adam baseline and against torch's best ZeRO, and the bytes each variant hands to
collectives per rank per iteration.

    python benchmarks/bench_overlap.py [--world-sizes 2 4] [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero  # noqa: E402

from zero_functional.hooks import hook_with_zero_step_interleaved  # noqa: E402
from zero_functional.optimizer import ZeroRedundancyOptimizer  # noqa: E402

from distributed import run_ranks  # noqa: E402

NAMES = ["ddp + fused adam", "torch zero best", "ours", "ours overlap"]


def _mlp(numel: int) -> nn.Module:
    width = 1000
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(max(1, numel // (width * width))):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def _build(name: str, numel: int) -> tuple[DDP, Any]:
    ddp = DDP(_mlp(numel))
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
    ddp.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, ddp, zero))
    return ddp, zero


def _bytes_per_iteration(name: str, model: nn.Module) -> int:
    """Bytes handed to collectives per rank per iteration: the all-reduced gradients, plus the
    broadcast parameters for the ZeRO variants (each rank sends or receives every shard)."""
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return size if name == "ddp + fused adam" else 2 * size


def _worker(rank: int, world_size: int, numel: int, rounds: int) -> dict[str, float]:
    torch.set_num_threads(max(1, 2 // world_size))
    variants = {name: _build(name, numel) for name in NAMES}
    x = torch.randn(32, 1000, generator=torch.Generator().manual_seed(rank))
    times: dict[str, list[float]] = {name: [] for name in NAMES}
    for r in range(rounds + 2):
        for name, (ddp, opt) in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            ddp(x).square().mean().backward()
            if name != "ours overlap":
                opt.step()
            if r >= 2:  # two warm-up rounds for every variant alike
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--numel", type=int, default=8_000_000)
    args = ap.parse_args()
    model = _mlp(args.numel)
    for ws in args.world_sizes:
        results = run_ranks(_worker, ws, args.numel, args.rounds, timeout_s=1800)
        med = {name: max(r[name] for r in results) for name in NAMES}
        print(f"\n== world size {ws}, {sum(p.numel() for p in model.parameters()):,} parameters")
        print(
            f"{'variant':<18}{'iter ms':>10}{'vs ddp+fused':>14}{'vs torch zero':>15}{'MB sent':>10}"
        )
        for name in NAMES:
            mb = _bytes_per_iteration(name, model) / 1e6
            print(
                f"{name:<18}{med[name] * 1e3:>10.1f}{med['ddp + fused adam'] / med[name]:>13.2f}x"
                f"{med['torch zero best'] / med[name]:>14.2f}x{mb:>10.1f}"
            )


if __name__ == "__main__":
    main()
