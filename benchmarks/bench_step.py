"""ZeroRedundancyOptimizer.step() for the 8M MLP and a small GPT: ours against torch's, same processes.

Variants, interleaved round by round inside the same gloo ranks so that they share the machine's
state: torch's defaults, torch's best (parameters_as_bucket_view=True, fused=True), ours at its
defaults (sorted-greedy), ours with bucket views, and ours under partition="flat" with and
without bucket views. Prints the median step time, its ratio to torch's best (below 1 is faster),
each rank's optimizer-state bytes, and the floor measured in the same rounds: the fused Adam
update of one rank's share, and the broadcast of every share on its own (what any step that
returns synced parameters pays unless it overlaps the two). ``ddp + fused`` is the unsharded
update alone (every rank steps every parameter; nothing to sync after DDP's all-reduce).

Models (``--models``): the MLP of ``--numel`` parameters in Linear(1000, 1000) layers, with
Adam; and the transformer-shaped ``_common.TinyGPT`` (77 tensors, 2.9M parameters, half of the
tensors biases and LayerNorm vectors), with AdamW.

Peak memory is measured apart, each variant in ranks of its own (in shared processes the
allocator's reuse of what an earlier variant freed hides what a later one needs): after a
warm-up on a tiny model (imports, the process group's buffers), the growth of the peak resident
set (Linux's VmHWM, reset first) from the model with its gradients to after four steps, on the
fullest rank.

    python benchmarks/bench_step.py [--world-sizes 2 4] [--rounds 15] [--numel 8000000]
        [--models mlp transformer] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

from _common import TinyGPT, mlp, run_ranks, start_peak, status_mib
from zero_functional.core.layout import piece_view
from zero_functional.optimizer import ZeroRedundancyOptimizer

DDP_FUSED = "ddp + fused"
FLOOR_UPDATE = "floor: fused update, one share"
FLOOR_WIRE = "floor: broadcast every share"
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


def _model(model: str, numel: int) -> nn.Module:
    return TinyGPT() if model == "transformer" else mlp(numel, relu=False)


def _cls(model: str) -> type[torch.optim.Optimizer]:
    return torch.optim.AdamW if model == "transformer" else torch.optim.Adam


def _state_bytes(opt: Any) -> int:
    state = opt.optim.state if isinstance(opt, TorchZero) else opt.state
    return sum(
        v.numel() * v.element_size()
        for s in state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def _worker(rank: int, world_size: int, model: str, numel: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(max(1, 2 // world_size))
    models, opts = [], []
    for _, cls, kw in VARIANTS:
        m = _model(model, numel)
        for p in m.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt = cls(m.parameters(), _cls(model), lr=1e-4, **kw)
        opt.step()  # allocate state
        models.append(m)
        opts.append(opt)
    unsharded = _model(model, numel)
    for p in unsharded.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    ddp_fused = _cls(model)(unsharded.parameters(), lr=1e-4, fused=True)
    # the floor of any step() that returns synced parameters: this rank's share of fused Adam,
    # then every share on the wire (one gloo broadcast per owner, of total / world_size)
    flat_opt = opts[[name for name, _, _ in VARIANTS].index("ours flat")]
    flat_params = [p for g in flat_opt.param_groups for p in g["params"]]
    share = torch.randn(sum(p.numel() for p in flat_params) // world_size)
    shares = [share.clone() for _ in range(world_size)]

    def update_only() -> None:
        owned = flat_opt.ownership.owned(rank)
        grads = {s.param: piece_view(flat_params[s.param].grad, s) for s in owned}
        flat_opt.update_owned(grads)

    def broadcast_only() -> None:
        works = [torch.distributed.broadcast(t, r, async_op=True) for r, t in enumerate(shares)]
        for w in works:
            w.wait()

    floors = {DDP_FUSED: ddp_fused.step, FLOOR_UPDATE: update_only, FLOOR_WIRE: broadcast_only}
    times: dict[str, list[float]] = {name: [] for name in [*(n for n, _, _ in VARIANTS), *floors]}
    for _ in range(rounds):
        calls = [*((name, opt.step) for (name, _, _), opt in zip(VARIANTS, opts)), *floors.items()]
        for name, call in calls:
            torch.distributed.barrier()
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    return {
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "state_bytes": {name: _state_bytes(o) for (name, _, _), o in zip(VARIANTS, opts)},
        "params": sum(p.numel() for p in models[0].parameters()),
    }


def _memory_worker(rank: int, world_size: int, model: str, numel: int, variant: int) -> float:
    """Peak resident-set growth (MiB) of one variant's four steps, after a warm-up."""
    torch.set_num_threads(max(1, 2 // world_size))
    _, cls, kw = VARIANTS[variant]
    warm = nn.Linear(4, 4)
    for p in warm.parameters():
        p.grad = torch.ones_like(p)
    warm_opt = cls(warm.parameters(), _cls(model), lr=1e-4, **kw)
    for _ in range(2):
        warm_opt.step()
    del warm_opt, warm
    m = _model(model, numel)
    for p in m.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    before = start_peak()
    opt = cls(m.parameters(), _cls(model), lr=1e-4, **kw)
    for _ in range(4):
        opt.step()
    if hasattr(opt, "finish_param_sync"):
        opt.finish_param_sync()
    return status_mib("VmHWM") - before


def _report(model: str, ws: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run and print one model at one world size; its rows for ``--json``."""
    results = run_ranks(_worker, ws, model, args.numel, args.rounds, timeout_s=1800)
    peak = {
        name: max(run_ranks(_memory_worker, ws, model, args.numel, i, timeout_s=600))
        for i, (name, _, _) in enumerate(VARIANTS)
    }
    # a step is as slow as its slowest rank
    names = [*(name for name, _, _ in VARIANTS), DDP_FUSED, FLOOR_UPDATE, FLOOR_WIRE]
    med = {name: max(r["median_s"][name] for r in results) for name in names}
    best = med["torch best"]
    n = results[0]["params"]
    opt = _cls(model).__name__
    label = f"{n / 1e6:.0f}M {opt}" if model == "mlp" else f"{n / 1e6:.1f}M transformer {opt}"
    print(f"\n== {label}, world size {ws}, {n:,} parameters, median of {args.rounds}")
    print(
        f"{'variant':<34}{'step ms':>10}{'x torch best':>15}{'state MiB/rank':>16}"
        f"{'peak MiB/rank':>15}"
    )
    rows = []
    for name, _, _ in VARIANTS:
        state = max(r["state_bytes"][name] for r in results) / 2**20
        print(
            f"{name:<34}{med[name] * 1e3:>10.1f}{med[name] / best:>14.2f}x{state:>16.1f}"
            f"{peak[name]:>15.1f}"
        )
        rows.append(
            {
                "benchmark": f"step ({label})",
                "world_size": ws,
                "variant": name,
                "ms": med[name] * 1e3,
                "vs_torch_best": med[name] / best,
                "state_mib": state,
                "peak_mib": peak[name],
            }
        )
    floor = med[FLOOR_UPDATE] + med[FLOOR_WIRE]
    for name in (DDP_FUSED, FLOOR_UPDATE, FLOOR_WIRE):
        print(f"{name:<34}{med[name] * 1e3:>10.1f}{med[name] / best:>14.2f}x")
    print(f"{'floor: one share + broadcast':<34}{floor * 1e3:>10.1f}{floor / best:>14.2f}x")
    for name, ms in ((DDP_FUSED, med[DDP_FUSED]), ("floor: one share + broadcast", floor)):
        rows.append(
            {
                "benchmark": f"step ({label})",
                "world_size": ws,
                "variant": name,
                "ms": ms * 1e3,
                "vs_torch_best": ms / best,
            }
        )
    print(
        f"ours default takes {med['ours default'] / med['torch default']:.2f}x the time of "
        f"torch's default and {med['ours default'] / best:.2f}x torch's best "
        f"({med['ours default'] / floor:.2f}x the floor of a step that returns synced parameters "
        f"without overlapping them); peak memory per rank {peak['ours default']:.1f} "
        f"MiB against torch's best's {peak['torch best']:.1f} and default's "
        f"{peak['torch default']:.1f}"
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--numel", type=int, default=8_000_000, help="the MLP's size")
    ap.add_argument(
        "--models", nargs="+", choices=["mlp", "transformer"], default=["mlp", "transformer"]
    )
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    args = ap.parse_args()
    rows = [r for model in args.models for ws in args.world_sizes for r in _report(model, ws, args)]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
