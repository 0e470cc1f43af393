"""ZeroRedundancyOptimizer.step() for an 8M-parameter model: ours against torch's, same processes.

Variants, interleaved round by round inside the same gloo ranks so that they share the machine's
state: torch's defaults, torch's best (parameters_as_bucket_view=True, fused=True), ours at its
defaults (sorted-greedy), ours with bucket views, and ours under partition="flat" with and
without bucket views. Prints the median step time, ratios against torch's best, and each rank's
optimizer-state bytes and resident-memory growth.

    python benchmarks/bench_step.py [--world-sizes 2 4] [--rounds 15] [--numel 8000000] [--json F]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

from _common import mlp, run_ranks
from zero_functional.optimizer import ZeroRedundancyOptimizer

VARIANTS: list[tuple[str, type, dict[str, Any]]] = [
    ("torch default", TorchZero, {}),
    ("torch best", TorchZero, {"parameters_as_bucket_view": True, "fused": True}),
    ("ours default", ZeroRedundancyOptimizer, {}),
    ("ours bucket view", ZeroRedundancyOptimizer, {"parameters_as_bucket_view": True}),
    ("ours flat", ZeroRedundancyOptimizer, {"partition": "flat"}),
    (
        "ours flat bucket view",
        ZeroRedundancyOptimizer,
        {"partition": "flat", "parameters_as_bucket_view": True},
    ),
]


def _model(numel: int) -> nn.Module:
    return mlp(numel, relu=False)


def _state_bytes(opt: Any) -> int:
    state = opt.optim.state if isinstance(opt, TorchZero) else opt.state
    return sum(
        v.numel() * v.element_size()
        for s in state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _worker(rank: int, world_size: int, numel: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(max(1, 2 // world_size))
    models, opts, rss = [], [], {}
    for name, cls, kw in VARIANTS:
        before = _rss_mib()
        m = _model(numel)
        for p in m.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt = cls(m.parameters(), torch.optim.Adam, lr=1e-4, **kw)
        opt.step()  # allocate state
        rss[name] = _rss_mib() - before
        models.append(m)
        opts.append(opt)
    times: dict[str, list[float]] = {name: [] for name, _, _ in VARIANTS}
    for _ in range(rounds):
        for (name, _, _), opt in zip(VARIANTS, opts):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    return {
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "state_bytes": {name: _state_bytes(o) for (name, _, _), o in zip(VARIANTS, opts)},
        "peak_rss_growth_mib": rss,
        "params": sum(p.numel() for p in models[0].parameters()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--numel", type=int, default=8_000_000)
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    args = ap.parse_args()
    rows = []
    for ws in args.world_sizes:
        results = run_ranks(_worker, ws, args.numel, args.rounds, timeout_s=1800)
        # a step is as slow as its slowest rank
        med = {name: max(r["median_s"][name] for r in results) for name, _, _ in VARIANTS}
        best = med["torch best"]
        print(
            f"\n== world size {ws}, {results[0]['params']:,} parameters, Adam, median of {args.rounds}"
        )
        print(
            f"{'variant':<24}{'step ms':>10}{'x torch best':>15}{'state MiB/rank':>16}"
            f"{'peak RSS growth MiB/rank':>26}"
        )
        for name, _, _ in VARIANTS:
            state = max(r["state_bytes"][name] for r in results) / 2**20
            rss = max(r["peak_rss_growth_mib"][name] for r in results)
            print(
                f"{name:<24}{med[name] * 1e3:>10.1f}{med[name] / best:>14.2f}x{state:>16.1f}"
                f"{rss:>26.1f}"
            )
            rows.append(
                {
                    "benchmark": f"step ({results[0]['params'] / 1e6:.0f}M Adam)",
                    "world_size": ws,
                    "variant": name,
                    "ms": med[name] * 1e3,
                    "vs_torch_best": med[name] / best,
                    "state_mib": state,
                }
            )
        print(
            f"ours default takes {med['ours default'] / med['torch default']:.2f}x the time of "
            f"torch's default and {med['ours default'] / best:.2f}x torch's best"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
