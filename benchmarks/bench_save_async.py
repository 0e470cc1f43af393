"""Checkpoints that do not stall training: how long ``checkpoint.save(blocking=False)`` blocks.

The benchmark model (8M parameters, Adam, partition="flat": 64 MB of optimizer state, 96 MB
with the parameters) on gloo ranks, one step taken so the state exists. Per round, on the same
ranks, interleaved:

* ``blocking save``: ``checkpoint.save(...)`` until it returns (committed): the reference;
* ``blocked by save(blocking=False)``: until ``save(..., blocking=False)`` returns (the state
  copied, the save planned): the time the training loop is blocked;
* ``until committed (background)``: from that call until ``.wait()`` returns, with one
  optimizer step run meanwhile: what the write costs end to end when it overlaps training.

Times are medians over rounds of the slowest rank; ``x blocking`` is over the blocking save of
the same run (issue 32 asks for <= 0.15x blocked).

    PYTHONPATH=src python benchmarks/bench_save_async.py [--world-sizes 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from _common import median_ms, mlp, run_ranks
from zero_functional import checkpoint
from zero_functional.optimizer import ZeroRedundancyOptimizer

VARIANTS = ("blocking save", "blocked by save(blocking=False)", "until committed (background)")


def _step(model: torch.nn.Module, opt: ZeroRedundancyOptimizer) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()


def _worker(rank: int, world_size: int, numel: int, rounds: int, root: str) -> dict[str, Any]:
    model = mlp(numel)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, partition="flat", lr=1e-4)
    _step(model, opt)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    path = os.path.join(root, "ckpt")
    checkpoint.save(path, model=model, optimizer=opt)  # warm-up: files exist, imports done
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        checkpoint.save(path, model=model, optimizer=opt)
        times[VARIANTS[0]].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        handle = checkpoint.save(path, model=model, optimizer=opt, blocking=False)
        times[VARIANTS[1]].append(time.perf_counter() - t0)
        _step(model, opt)  # training goes on while the thread writes
        handle.wait()
        times[VARIANTS[2]].append(time.perf_counter() - t0)
    state = sum(
        t.numel() * t.element_size()
        for _, s in opt.shard_state().values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    return {"times": times, "state_bytes": state}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--numel", type=int, default=8_000_000)
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    args = ap.parse_args()
    rows = []
    for ws in args.world_sizes:
        root = tempfile.mkdtemp(prefix="zf-bench-save-async-")
        try:
            results = run_ranks(_worker, ws, args.numel, args.rounds, root, timeout_s=1800)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        state_mb = sum(r["state_bytes"] for r in results) / 2**20
        print(
            f"\n== world size {ws}: Adam state {state_mb:.0f} MiB in all; "
            f"{args.rounds} rounds, medians of the slowest rank"
        )
        print(f"{'variant':<34}{'ms':>9}{'x blocking':>12}")
        slowest = {
            name: [max(r["times"][name][i] for r in results) for i in range(args.rounds)]
            for name in VARIANTS
        }
        blocking = median_ms(slowest[VARIANTS[0]])
        for name in VARIANTS:
            ms = median_ms(slowest[name])
            print(f"{name:<34}{ms:>9.1f}{ms / blocking:>11.2f}x")
            rows.append(
                {
                    "benchmark": "checkpoint save, async",
                    "world_size": ws,
                    "variant": name,
                    "ms": ms,
                    "vs_torch_best": ms / blocking,  # here: x our blocking save
                }
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
