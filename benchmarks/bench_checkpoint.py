"""Checkpoint save and load: sharded (zero_functional.checkpoint) against consolidation + torch.save.

The benchmark model (8M parameters, Adam, partition="flat") on 2-4 gloo ranks, one step taken so
the state exists. Per variant, the time of the slowest rank and each rank's peak extra resident
memory (VmHWM reset before the call, a 1 ms sampler beside it; glibc is told to return freed
blocks, so freed buffers leave the resident set):

* ``torch: consolidate + torch.save``: torch's ZeroRedundancyOptimizer: ``consolidate_state_dict``
  (every shard to rank 0) then ``torch.save`` of model and optimizer on rank 0; load:
  ``torch.load`` on every rank and ``load_state_dict``;
* ``ours: consolidate + torch.save``: the same through our class (shards arrive one at a time);
* ``ours: sharded``: ``checkpoint.save`` / ``checkpoint.load``: each rank writes and reads its
  own share, checksummed; no optimizer-state byte crosses the process group.

The optimizer state is 8 B x 8M = 64 MB in all, 64/N MB per rank; the sharded save should need at
most one stored chunk (``storage.DEFAULT_MAX_BOX_NUMEL`` elements) beyond it.

    MALLOC_MMAP_THRESHOLD_=1048576 python benchmarks/bench_checkpoint.py [--world-sizes 2 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

from _common import mlp, run_ranks
from zero_functional import checkpoint
from zero_functional.checkpoint.storage import DEFAULT_MAX_BOX_NUMEL
from zero_functional.optimizer import ZeroRedundancyOptimizer

PAGE = os.sysconf("SC_PAGE_SIZE")
VARIANTS = ("torch: consolidate + torch.save", "ours: consolidate + torch.save", "ours: sharded")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class Peak:
    """Peak resident memory above the level at entry, and the seconds spent."""

    def __enter__(self) -> Peak:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := the current RSS (Linux >= 4.0)
        self.base = self.peak = _rss()
        self.stop = False
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        self.t0 = time.perf_counter()
        return self

    def _sample(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.stop = True
        self.thread.join()
        self.extra_mb = (max(self.peak, _rss(), _hwm()) - self.base) / 2**20


def _setup(name: str, numel: int, step: bool = True) -> tuple[torch.nn.Module, Any]:
    model = mlp(numel)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3 if step else None
    if name.startswith("torch"):
        opt: Any = TorchZero(model.parameters(), torch.optim.Adam, lr=1e-4)
    else:
        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.Adam, partition="flat", lr=1e-4
        )
    if step:
        opt.step()
    return model, opt


def _worker(rank: int, world_size: int, numel: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in VARIANTS:
        model, opt = _setup(name, numel)
        path = os.path.join(root, name.split(":")[0] + name.split()[-1])
        dist.barrier()
        with Peak() as save:
            if name.endswith("sharded"):
                checkpoint.save(path, model=model, optimizer=opt)
            else:
                opt.consolidate_state_dict(to=0)
                if rank == 0:
                    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
            dist.barrier()
        model, opt = _setup(name, numel, step=False)  # a fresh optimizer to load into
        dist.barrier()
        with Peak() as load:
            if name.endswith("sharded"):
                checkpoint.load(path, model=model, optimizer=opt)
            else:
                blob = torch.load(path, weights_only=False)
                model.load_state_dict(blob["model"])
                opt.load_state_dict(blob["optim"])
                del blob
            dist.barrier()
        out[name] = (save.seconds, save.extra_mb, load.seconds, load.extra_mb)
        del model, opt
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--numel", type=int, default=8_000_000)
    ap.add_argument("--rounds", type=int, help="ignored: one save and one load per variant")
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    args = ap.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    total = sum(p.numel() for p in mlp(args.numel).parameters())
    state_mb = 8 * total / 2**20
    chunk_mb = DEFAULT_MAX_BOX_NUMEL * 4 / 2**20
    rows = []
    for ws in args.world_sizes:
        root = tempfile.mkdtemp(prefix="zf-bench-ckpt-")
        try:
            results = run_ranks(_worker, ws, args.numel, root, timeout_s=1800)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(
            f"\n== world size {ws}: Adam state {state_mb:.0f} MiB in all, {state_mb / ws:.0f} MiB "
            f"per rank; one stored chunk {chunk_mb:.0f} MiB"
        )
        print(
            f"{'variant':<32}{'save s':>8}{'load s':>8}"
            f"{'save peak MiB per rank':>28}{'load peak MiB per rank':>28}"
        )
        torch_save = max(r[VARIANTS[0]][0] for r in results)
        for name in VARIANTS:
            save_s = max(r[name][0] for r in results)
            load_s = max(r[name][2] for r in results)
            save_mb = " ".join(f"{r[name][1]:.0f}" for r in results)
            load_mb = " ".join(f"{r[name][3]:.0f}" for r in results)
            print(f"{name:<32}{save_s:>8.2f}{load_s:>8.2f}{save_mb:>28}{load_mb:>28}")
            rows.append(
                {
                    "benchmark": "checkpoint save",
                    "world_size": ws,
                    "variant": name,
                    "ms": save_s * 1e3,
                    "vs_torch_best": save_s / torch_save,
                }
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
