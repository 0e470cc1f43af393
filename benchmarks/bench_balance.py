"""Optimizer memory per rank: sorted-greedy (torch's) against the flat split, predicted and measured.

1. Predicted, pure: for GPT-2 small, BERT-base and Llama-3.2-1B shapes at 2, 3, 4, 8, 16 and 64
   ranks, the fullest rank's elements over the mean (1.000 is ZeRO's promise) under torch's
   sorted-greedy and under our flat ownership (fp32 alignment, as the optimizer builds it).
2. Measured: the 8M-parameter benchmark model with Adam on 2-4 gloo ranks, one step; each rank's
   optimizer-state bytes (``exp_avg`` + ``exp_avg_sq``) against ZeRO's ``8 B x total / N``, for
   torch's ZeroRedundancyOptimizer, ours under sorted-greedy and ours under flat.

    python benchmarks/bench_balance.py [--world-sizes 2 3 4] [--numel 8000000] [--json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

from _common import mlp, run_ranks
from zero_functional.app.models import model_shapes, numels
from zero_functional.core.ownership import flat_ownership, sorted_greedy_ownership
from zero_functional.optimizer import ZeroRedundancyOptimizer

MODELS = ("gpt2-small", "bert-base", "llama-1b")
PLAN_WORLD_SIZES = (2, 3, 4, 8, 16, 64)


def predicted() -> list[dict[str, Any]]:
    rows = []
    print("predicted: fullest rank's elements / mean (1.000 = ZeRO's total / N)")
    print(f"{'model':<12}" + "".join(f"{w:>16}" for w in PLAN_WORLD_SIZES))
    for name in MODELS:
        sizes = numels(model_shapes(name))
        cells = []
        for w in PLAN_WORLD_SIZES:
            mean = sum(sizes) / w
            greedy = max(sorted_greedy_ownership([sizes], w).loads) / mean
            flat = max(flat_ownership(sizes, w, align=4).loads) / mean
            cells.append(f"{greedy:>7.3f} | {flat:<6.4f}")
            rows.append({"model": name, "world_size": w, "sorted_greedy": greedy, "flat": flat})
        print(f"{name:<12}" + "".join(f"{c:>16}" for c in cells))
    print("(each cell: sorted-greedy | flat)")
    return rows


VARIANTS = ("torch ZeRO", "ours sorted_greedy", "ours flat")


def _moments(opt: Any) -> int:
    state = opt.optim.state if isinstance(opt, TorchZero) else opt.state
    return sum(
        v.numel() * v.element_size()
        for s in state.values()
        for k, v in s.items()
        if k in ("exp_avg", "exp_avg_sq")
    )


def _worker(rank: int, world_size: int, numel: int) -> dict[str, int]:
    out = {}
    for name in VARIANTS:
        model = mlp(numel)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        if name == "torch ZeRO":
            opt: Any = TorchZero(model.parameters(), torch.optim.Adam, lr=1e-3)
        else:
            partition = name.split()[-1]
            opt = ZeroRedundancyOptimizer(
                model.parameters(), torch.optim.Adam, partition=partition, lr=1e-3
            )
        opt.step()
        out[name] = _moments(opt)
    return out


def measured(world_sizes: list[int], numel: int) -> list[dict[str, Any]]:
    total = sum(p.numel() for p in mlp(numel).parameters())
    print(f"\nmeasured: Adam moments per rank, {total:,} parameters, one step")
    print(f"{'ranks':>5}  {'variant':<20}{'per rank (MB)':>30}  {'max / (8 B x total / N)':>24}")
    rows = []
    for w in world_sizes:
        per_rank = run_ranks(_worker, w, numel, timeout_s=600)
        ideal = 8 * total / w
        for name in VARIANTS:
            values = [r[name] for r in per_rank]
            ratio = max(values) / ideal
            each = " ".join(f"{v / 1e6:.2f}" for v in values)
            print(f"{w:>5}  {name:<20}{each:>30}  {ratio:>24.4f}")
            rows.append(
                {"world_size": w, "variant": name, "bytes": values, "max_over_ideal": ratio}
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--numel", type=int, default=8_000_000)
    ap.add_argument("--rounds", type=int, help="ignored (the other benchmarks time rounds)")
    ap.add_argument("--json", help="write the summary rows (none: this benchmark times nothing)")
    args = ap.parse_args()
    predicted()
    measured(args.world_sizes, args.numel)
    if args.json:
        Path(args.json).write_text(json.dumps([]))


if __name__ == "__main__":
    main()
