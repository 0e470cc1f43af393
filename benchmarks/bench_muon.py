"""Muon with AdamW (issue 30): ours against DDP + torch.optim.Muon, and against torch's ZeRO with Muon.

Muon's hidden matrices are owned whole by one rank each (under ``partition="flat"`` balanced by
their Newton–Schulz cost, m·n·min(m, n)), so each rank runs Newton–Schulz on its own matrices
only, where DDP + ``torch.optim.Muon`` runs it on every matrix on every rank.

The GPT-shaped model is ``_common.TinyGPT(width=--width)`` (48 by default, 192 its own): 6
blocks of attention qkv/proj and MLP up/down (24 matrices, Muon with lr 0.02), embeddings,
LayerNorms, biases and the head with AdamW (lr 3e-4, weight decay 0.1): the recipe of
``tests/dist/test_muon.py``. Variants, interleaved round by round inside the same gloo ranks
(two warm-up rounds, then ``--rounds``), each timing a whole iteration (forward, backward, step;
batch 8 per rank) and its ``step()`` alone, in wall time and in the rank's CPU time (all its
threads: gloo's too), which a loaded machine disturbs less:

* ``ddp + muon``: DDP's all-reduce, then every rank steps every parameter with
  ``torch.optim.Muon`` + ``torch.optim.AdamW(fused=True)``: the baseline, 1.00x;
* ``ours``: DDP's all-reduce, then our ``ZeroRedundancyOptimizer`` with the recipe,
  ``partition="flat"``, step after backward: each large matrix is updated, then broadcast on its
  own while the next is updated (smaller tensors packed per owner, last);
* ``ours + reduce_scatter_hook``: the same with each gradient reduced onto its owner only;
* ``ours, bucket view``: ``ours`` with ``parameters_as_bucket_view=True``: one update of this
  rank's pieces, then each run of one owner's elements in the shared buffer broadcast in place
  (one run per owner where every parameter is owned whole).

The profile, measured in the same rounds on the same ranks: Newton–Schulz (``torch.optim.Muon``'s
step) over every matrix and over this rank's own matrices, the baseline's fused AdamW over the
rest, and the broadcast of every owner's share in one buffer per owner (the floor of what a step
sends).

Matrices only, ``step()`` only, with fixed random gradients: ``torch zero`` = torch's
``ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Muon)`` (the baseline, 1.00x) and
with ``parameters_as_bucket_view=True``, against ours with ``optimizer_class=torch.optim.Muon``
(its default partition, sorted-greedy by elements: one per-tensor class for every group is
refused under ``"flat"``, as before issue 30) and ours with the class in the group and
``partition="flat"`` (owned whole, balanced by Newton–Schulz cost). Two sets of matrices: the
GPT's 24 (each has min(m, n) = width, so the cost is proportional to the elements and both
balances agree), and :data:`MIXED_SHAPES`, where they differ.

Times are medians of the slowest rank; ratios against the baseline of the same run.

    python benchmarks/bench_muon.py [--world-sizes 2 4] [--rounds 10] [--width 48] [--json F]

``--numel`` is accepted (``zero-functional bench`` forwards it) and ignored: the models are
fixed by their shapes.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import TinyGPT, gpt_batch, median_ms, run_ranks
from zero_functional.hooks import reduce_scatter_hook
from zero_functional.optimizer import ZeroRedundancyOptimizer

WIDTH = 48
BASELINE = "ddp + muon"
MATRIX_BASELINE = "torch zero"
BUCKET_VIEW = "ours, bucket view"
ITER_VARIANTS = [BASELINE, "ours", "ours + reduce_scatter_hook", BUCKET_VIEW]
MATRIX_VARIANTS = [MATRIX_BASELINE, "torch zero, bucket view", "ours", "ours flat, by cost"]
# 6 squares and 3 rectangles of twice their elements but an eighth of their Newton–Schulz cost
# each (m·n·min(m, n)): element counts put three squares on one rank at 2 and 4 ranks
MIXED_SHAPES = [(1536, 12)] * 3 + [(96, 96)] * 6
PIECES = [
    "piece: muon, every matrix",
    "piece: muon, this rank's matrices",
    "piece: adamw (fused), every other parameter",
    "piece: broadcast every share, one buffer per owner",
]


def _model(width: int) -> TinyGPT:
    return TinyGPT(width=width)


def _split(model: TinyGPT) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The blocks' matrices (Muon) and the rest (AdamW), in the model's order."""
    matrices = [p for p in model.blocks.parameters() if p.ndim == 2]
    ids = {id(p) for p in matrices}
    return matrices, [p for p in model.parameters() if id(p) not in ids]


def _recipe(model: TinyGPT, bucket_view: bool = False) -> ZeroRedundancyOptimizer:
    matrices, rest = _split(model)
    return ZeroRedundancyOptimizer(
        [{"params": matrices, "optimizer_class": torch.optim.Muon, "lr": 0.02}, {"params": rest}],
        optimizer_class=torch.optim.AdamW,
        partition="flat",
        lr=3e-4,
        weight_decay=0.1,
        parameters_as_bucket_view=bucket_view,
    )


def _build(name: str, width: int) -> tuple[DDP, list[Any]]:
    ddp = DDP(_model(width))
    if name == BASELINE:
        matrices, rest = _split(ddp.module)
        return ddp, [
            torch.optim.Muon(matrices, lr=0.02),
            torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.1, fused=True),
        ]
    zero = _recipe(ddp.module, bucket_view=name == BUCKET_VIEW)
    if name == "ours + reduce_scatter_hook":
        ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
    return ddp, [zero]


def _iteration(ddp: DDP, opts: list[Any], tokens: Tensor) -> tuple[float, float, float]:
    """One forward, backward and step; (iteration s, step s, step's CPU s in this process)."""
    for o in opts:
        o.zero_grad()
    t0 = time.perf_counter()
    TinyGPT.loss(ddp(tokens[:, :-1]), tokens[:, 1:]).backward()
    t1, c1 = time.perf_counter(), time.process_time()
    for o in opts:
        o.step()
    t2, c2 = time.perf_counter(), time.process_time()
    return t2 - t0, t2 - t1, c2 - c1


def _pieces(rank: int, world_size: int, zero: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """The profile's pieces, each a call timed on its own: Newton–Schulz everywhere and on this
    rank's matrices (``zero``'s ownership), fused AdamW over the rest, and every owner's share
    broadcast in one buffer."""
    params = zero.param_table.params
    n_matrices = len(zero.param_groups[0]["params"])
    owner = {s.param: r for r in range(world_size) for s in zero.ownership.owned(r)}

    def muon_over(indices: list[int]) -> Any:
        ps = [nn.Parameter(params[i].detach().clone()) for i in indices]
        for p in ps:
            p.grad = torch.randn_like(p) * 1e-3
        return torch.optim.Muon(ps, lr=0.02).step if ps else (lambda: None)

    every = muon_over(list(range(n_matrices)))
    mine = muon_over([i for i in range(n_matrices) if owner[i] == rank])
    rest = [nn.Parameter(p.detach().clone()) for p in params[n_matrices:]]
    for p in rest:
        p.grad = torch.randn_like(p) * 1e-3
    adamw = torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.1, fused=True).step
    # one flat buffer per owner, of what it owns: the fewest broadcasts a step can send
    shares = [
        torch.zeros(sum(s.stop - s.start for s in zero.ownership.owned(r)))
        for r in range(world_size)
    ]

    def broadcast() -> None:
        works = [dist.broadcast(t, r, async_op=True) for r, t in enumerate(shares)]
        for w in works:
            w.wait()

    return dict(zip(PIECES, (every, mine, adamw, broadcast)))


def _gpt_worker(rank: int, world_size: int, rounds: int, width: int) -> dict[str, Any]:
    torch.set_num_threads(max(1, 2 // world_size))
    tokens = gpt_batch(rank, context=64, vocab=512)
    built = {name: _build(name, width) for name in ITER_VARIANTS}
    pieces = _pieces(rank, world_size, built["ours"][1][0])
    iters: dict[str, list[float]] = {name: [] for name in ITER_VARIANTS}
    steps: dict[str, list[float]] = {name: [] for name in ITER_VARIANTS}
    cpus: dict[str, list[float]] = {name: [] for name in ITER_VARIANTS}
    alone: dict[str, list[float]] = {name: [] for name in PIECES}
    for r in range(rounds + 2):
        for name, (ddp, opts) in built.items():
            dist.barrier()
            it, st, cpu = _iteration(ddp, opts, tokens)
            if r >= 2:  # two warm-up rounds for every variant alike
                iters[name].append(it)
                steps[name].append(st)
                cpus[name].append(cpu)
        for name, call in pieces.items():
            dist.barrier()
            t0 = time.perf_counter()
            call()
            if r >= 2:
                alone[name].append(time.perf_counter() - t0)
    base = list(built[BASELINE][0].module.parameters())
    diff = {
        name: max((a - b).abs().max().item() for a, b in zip(ddp.module.parameters(), base))
        for name, (ddp, _) in built.items()
    }
    return {
        "iter": {k: median_ms(v) for k, v in iters.items()},
        "step": {k: median_ms(v) for k, v in steps.items()},
        "cpu": {k: median_ms(v) for k, v in cpus.items()},
        "pieces": {k: median_ms(v) for k, v in alone.items()},
        "diff": diff,
    }


def _matrices(shapes: str, width: int) -> list[nn.Parameter]:
    """The GPT's 24 block matrices (``"gpt"``) or :data:`MIXED_SHAPES` (``"mixed"``), seeded."""
    if shapes == "gpt":
        return _split(_model(width))[0]
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(m, n) * 0.02) for m, n in MIXED_SHAPES]


def _matrix_worker(
    rank: int, world_size: int, rounds: int, shapes: str, width: int
) -> dict[str, Any]:
    torch.set_num_threads(max(1, 2 // world_size))
    opts: dict[str, Any] = {}
    for name in MATRIX_VARIANTS:
        matrices = _matrices(shapes, width)
        g = torch.Generator().manual_seed(rank)
        for p in matrices:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        if name.startswith("torch"):
            opts[name] = TorchZero(
                matrices,
                optimizer_class=torch.optim.Muon,
                parameters_as_bucket_view=name != MATRIX_BASELINE,
                lr=0.02,
            )
        elif name == "ours":
            opts[name] = ZeroRedundancyOptimizer(
                matrices, optimizer_class=torch.optim.Muon, lr=0.02
            )
        else:  # the class in the group: owned whole under "flat", balanced by cost
            opts[name] = ZeroRedundancyOptimizer(
                [{"params": matrices, "optimizer_class": torch.optim.Muon}],
                optimizer_class=torch.optim.Muon,
                partition="flat",
                lr=0.02,
            )
    times: dict[str, list[float]] = {name: [] for name in MATRIX_VARIANTS}
    for r in range(rounds + 2):
        for name, opt in opts.items():
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            if r >= 2:
                times[name].append(time.perf_counter() - t0)
    return {"step": {k: median_ms(v) for k, v in times.items()}}


def _row(benchmark: str, ws: int, variant: str, ms: float, base: float) -> dict[str, Any]:
    return {
        "benchmark": benchmark,
        "world_size": ws,
        "variant": variant,
        "ms": ms,
        "vs_torch_best": ms / base,
    }


def _report_gpt(ws: int, rounds: int, width: int) -> list[dict[str, Any]]:
    results = run_ranks(_gpt_worker, ws, rounds, width, timeout_s=1800)
    n = sum(p.numel() for p in _model(width).parameters())
    label = f"GPT {n / 1e6:.2f}M width {width}, 24 matrices"

    def slowest(kind: str, name: str) -> float:
        return max(r[kind][name] for r in results)

    step_base, iter_base = slowest("step", BASELINE), slowest("iter", BASELINE)
    cpu_base = slowest("cpu", BASELINE)
    print(f"\n== Muon + AdamW, {label}, world size {ws}, median of {rounds} rounds")
    print(
        f"{'variant':<50}{'step ms':>9}{'x ddp':>8}{'cpu ms':>9}{'x ddp':>8}"
        f"{'iter ms':>10}{'x ddp':>8}{'max|dp|':>10}"
    )
    rows = []
    for name in ITER_VARIANTS:
        st, it, cpu = slowest("step", name), slowest("iter", name), slowest("cpu", name)
        diff = max(r["diff"][name] for r in results)
        print(
            f"{name:<50}{st:>9.1f}{st / step_base:>7.2f}x{cpu:>9.1f}{cpu / cpu_base:>7.2f}x"
            f"{it:>10.1f}{it / iter_base:>7.2f}x{diff:>10.1e}"
        )
        rows.append(_row(f"muon step ({label})", ws, name, st, step_base))
        rows.append(_row(f"muon iteration ({label})", ws, name, it, iter_base))
    for name in PIECES:
        ms = slowest("pieces", name)
        print(f"{name:<50}{ms:>9.1f}{ms / step_base:>7.2f}x")
    return rows


def _report_matrices(ws: int, rounds: int, shapes: str, width: int) -> list[dict[str, Any]]:
    results = run_ranks(_matrix_worker, ws, rounds, shapes, width, timeout_s=1800)
    label = f"24 matrices (width {width}) only" if shapes == "gpt" else "mixed shapes only"
    base = max(r["step"][MATRIX_BASELINE] for r in results)
    print(f"\n== Muon alone, {label}, world size {ws}, median of {rounds} rounds")
    print(f"{'variant':<50}{'step ms':>9}{'x torch zero':>14}")
    rows = []
    for name in MATRIX_VARIANTS:
        ms = max(r["step"][name] for r in results)
        print(f"{name:<50}{ms:>9.1f}{ms / base:>13.2f}x")
        rows.append(_row(f"muon step ({label})", ws, name, ms, base))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--width", type=int, default=WIDTH, help="the GPT's width (6 heads)")
    ap.add_argument("--numel", type=int, help="ignored: the models are fixed by their shapes")
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    args = ap.parse_args()
    print("$ python " + shlex.join(sys.argv), flush=True)
    rows = []
    for ws in args.world_sizes:
        rows += _report_gpt(ws, args.rounds, args.width)
        rows += _report_matrices(ws, args.rounds, "gpt", args.width)
        rows += _report_matrices(ws, args.rounds, "mixed", args.width)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
