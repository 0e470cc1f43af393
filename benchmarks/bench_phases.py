"""Where an iteration's time goes, phase by phase: forward, backward, step (DDP against ours).

Plain DDP + fused Adam, ours (``partition="flat"``) with ``reduce_scatter_hook``, ours in
overlap mode (``hook_with_zero_step_interleaved``) and torch's best ZeRO, interleaved iteration by iteration inside the
same gloo ranks; medians of the slowest rank. On a shaped link (``--link RATE``) the phases show
the one difference the bytes leave: DDP's all-reduce of its small first bucket runs during the
rest of backward, while a ZeRO step after backward must all-gather every parameter after the
update, that bucket's too, with nothing left to overlap it. The last line prints the ratio
that predicts: DDP's iteration + the first bucket's all-gather at the link's rate - the Adam
that sharding saves.

    python benchmarks/bench_phases.py [--world-sizes 2 4] [--rounds 20] [--link 2gbit]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import add_link_argument, median_ms, mlp, run_ranks
from zero_functional.app.link import byte_floor_ms, run_shaped
from zero_functional.hooks import hook_with_zero_step_interleaved, reduce_scatter_hook
from zero_functional.optimizer import ZeroRedundancyOptimizer

MODES = [
    "ddp + fused adam",
    "ours flat, reduce_scatter_hook",
    "ours overlap flat",
    "torch zero best",
]
PHASES = ["forward", "backward", "step", "iteration"]


def _build(mode: str, numel: int, width: int) -> tuple[DDP, Any]:
    ddp = DDP(mlp(numel, width=width))
    if mode == MODES[0]:
        return ddp, torch.optim.Adam(ddp.parameters(), lr=1e-4, fused=True)
    if mode == "torch zero best":  # bucket views and the fused kernel
        return ddp, TorchZero(
            ddp.parameters(), torch.optim.Adam, parameters_as_bucket_view=True, lr=1e-4, fused=True
        )
    overlap = "overlap" in mode
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.Adam, lr=1e-4, partition="flat", overlap_with_ddp=overlap
    )
    if overlap:
        ddp.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, ddp, zero))
    else:
        ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
    return ddp, zero


def _worker(rank: int, world_size: int, numel: int, width: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(max(1, 2 // world_size))
    x = torch.randn(32, width, generator=torch.Generator().manual_seed(rank))
    built = {mode: _build(mode, numel, width) for mode in MODES}
    times: dict[str, dict[str, list[float]]] = {m: {p: [] for p in PHASES} for m in MODES}
    for r in range(rounds + 3):
        for mode, (ddp, opt) in built.items():
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = ddp(x).square().mean()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            if "overlap" not in mode:
                opt.step()
            t3 = time.perf_counter()
            if r >= 3:  # past DDP's bucket rebuild and overlap mode's adoption
                for phase, t in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                    times[mode][phase].append(t)
    out = {m: {p: median_ms(v) for p, v in ph.items()} for m, ph in times.items()}
    # DDP's first bucket: parameters in reverse order until it holds 1 MiB (torch's cap for it)
    size = 0
    for p in reversed(list(built[MODES[0]][0].module.parameters())):
        size += p.numel() * p.element_size()
        if size >= 2**20:
            break
    return {"ms": out, "first_bucket_bytes": size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--numel", type=int, help="the MLP's size (8 x width x width)")
    ap.add_argument("--width", type=int, default=512, help="the MLP's layer width (512)")
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    add_link_argument(ap)
    args = ap.parse_args()
    run_shaped(args.link)
    numel = args.numel or 8 * args.width * args.width
    # the label counts the model's parameters: mlp() keeps whole layers (2M at width 512: 1.8M)
    label = f"{sum(p.numel() for p in mlp(numel, width=args.width).parameters()) / 1e6:.1f}M MLP"
    rows = []
    for ws in args.world_sizes:
        results = run_ranks(_worker, ws, numel, args.width, args.rounds, timeout_s=1800)
        ms = {m: {p: max(r["ms"][m][p] for r in results) for p in PHASES} for m in MODES}
        base = ms[MODES[0]]["iteration"]
        link = f" on {args.link}" if args.link else ""
        print(f"\n== {label}{link}, world size {ws}, median of {args.rounds} rounds")
        print(f"{'variant':<34}" + "".join(f"{p:>11}" for p in PHASES) + f"{'x ddp':>8}")
        for m in MODES:
            t = ms[m]
            print(
                f"{m:<34}"
                + "".join(f"{t[p]:>11.1f}" for p in PHASES)
                + f"{t['iteration'] / base:>7.2f}x"
            )
            rows.append(
                {
                    "benchmark": f"phases ({label}{link})",
                    "world_size": ws,
                    "variant": m,
                    "ms": t["iteration"],
                    "vs_torch_best": t["iteration"] / ms["torch zero best"]["iteration"],
                    "vs_ddp": t["iteration"] / base,
                    **{p: t[p] for p in PHASES[:3]},
                }
            )
        if args.link:  # the first bucket's all-gather at the rate, less the Adam sharding saves
            gather = byte_floor_ms((ws - 1) * results[0]["first_bucket_bytes"], args.link)
            saved = ms[MODES[0]]["step"] * (ws - 1) / ws
            print(
                f"predicted after backward: (DDP + the first bucket's all-gather {gather:.1f} ms "
                f"- {saved:.1f} ms of Adam) / DDP = {(base + gather - saved) / base:.2f}x"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
