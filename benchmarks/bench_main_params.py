"""fp32 main parameters on a bf16 model (issue 22): learning, optimizer bytes, bytes moved.

Every number is measured in the same run, in the same gloo ranks:

(a) **Stagnation probe.** The share of a bf16 MLP's weights (64 -> 128 -> 64, GELU) that 10
    AdamW steps at lr=1e-4 change, under DDP: torch's ``ZeroRedundancyOptimizer`` (its AdamW
    state is bf16), ours without main parameters, ours with ``main_params_dtype=torch.float32``,
    and a single-process reference (fp32 main weights + ``torch.optim.AdamW`` on the whole
    global batch, the bf16 gradients upcast, the model = ``main.to(bfloat16)`` after each step).
(b) **Optimizer bytes per rank**, the per-element state tensors' ``nbytes`` summed on each rank
    after one step (the scalar ``step`` counters, 4 B per tensor or piece, left out): ours under
    ``partition="flat"`` with and without main parameters, torch's class on the same bf16 model,
    and DDP with an fp32-main AdamW on every rank (an fp32 copy and fp32 moments of every
    element: 12 B x total). Ours with main parameters must be exactly 12 B x owned elements.
(c) **Bytes moved per step** by our collectives with ``reduce_scatter_hook`` + flat +
    ``main_params_dtype``, counted from the collectives that ran (``torch.distributed``'s
    reduce, broadcast, all-reduce, reduce-scatter and all-gather wrapped while one iteration
    runs): the gradient half (reduces onto owners) and the parameter half (the owners'
    pieces gathered), in buffer bytes per model element, with and without
    ``reduce_dtype=torch.float32``. bf16: 2 + 2; with ``reduce_dtype``: 4 + 2.

The step times of (b)'s optimizers (median of ``--rounds`` ``step()`` calls, interleaved) go to
``--json`` for ``zero-functional bench``'s summary, against torch's class.

    python benchmarks/bench_main_params.py [--quick] [--world-sizes 2 3 4] [--numel 4000000]
        [--rounds 10] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import ByteCounter, mlp, run_ranks
from zero_functional.hooks import reduce_scatter_hook
from zero_functional.optimizer import ZeroRedundancyOptimizer

BF16 = torch.bfloat16
PROBE_STEPS, PROBE_LR, PROBE_BATCH = 10, 1e-4, 32
PROBE = ["torch ZeRO (bf16 state)", "ours, no main params", "ours, main fp32", "reference"]
PROBE_LABELS = {
    "torch ZeRO (bf16 state)": "torch ZeroRedundancyOptimizer (bf16 AdamW state)",
    "ours, no main params": "ours, main_params_dtype=None (bf16 AdamW state)",
    "ours, main fp32": "ours, main_params_dtype=torch.float32",
    "reference": "1 process: fp32 main weights + torch.optim.AdamW",
}
TORCH_ZERO = "torch's ZeRO: bf16 state"
OURS_MAIN = "ours flat, main fp32"
OURS_PLAIN = "ours flat, bf16 state"
DDP_MAIN = "DDP + fp32-main AdamW"
MEMORY = [OURS_MAIN, TORCH_ZERO, OURS_PLAIN, DDP_MAIN]


class _MainAdamW:
    """AdamW on fp32 copies of ``params`` (the gradients upcast; the params the copies rounded)."""

    def __init__(self, params: list[Tensor], **kw: Any) -> None:
        self.params = params
        self.main = [p.detach().float() for p in params]
        self.optim = torch.optim.AdamW(self.main, **kw)

    @torch.no_grad()
    def step(self) -> None:
        for m, p in zip(self.main, self.params):
            m.grad = None if p.grad is None else p.grad.float()
        self.optim.step()
        for m, p in zip(self.main, self.params):
            p.copy_(m)


def _probe_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(BF16)


def _probe_batch(step: int, rank: int) -> Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(PROBE_BATCH, 64, generator=g).to(BF16)


def _changed(model: nn.Module, before: list[Tensor]) -> float:
    moved = sum(int((p != b).sum()) for p, b in zip(model.parameters(), before))
    return moved / sum(b.numel() for b in before)


def _probe(variant: str, rank: int, world_size: int) -> float:
    """(a): the share of weights 10 AdamW steps change."""
    model = _probe_model()
    before = [p.detach().clone() for p in model.parameters()]
    if variant == "reference":  # the global batch in one process, no collective
        ref = _MainAdamW(list(model.parameters()), lr=PROBE_LR)
        for step in range(PROBE_STEPS):
            x = torch.cat([_probe_batch(step, r) for r in range(world_size)])
            model.zero_grad()
            model(x).float().pow(2).mean().backward()
            ref.step()
        return _changed(model, before)
    ddp = DDP(model)
    kw: dict[str, Any] = {"lr": PROBE_LR}
    if variant == "torch ZeRO (bf16 state)":
        opt: Any = TorchZero(ddp.parameters(), torch.optim.AdamW, **kw)
    else:
        main = torch.float32 if variant == "ours, main fp32" else None
        opt = ZeroRedundancyOptimizer(
            ddp.parameters(), torch.optim.AdamW, main_params_dtype=main, **kw
        )
    for step in range(PROBE_STEPS):
        opt.zero_grad()
        ddp(_probe_batch(step, rank)).float().pow(2).mean().backward()  # DDP: the global mean
        opt.step()
    return _changed(model, before)


def _state_bytes(state: dict[Any, dict[str, Any]]) -> int:
    """The per-element state's bytes (the scalar ``step`` counters left out)."""
    return sum(
        v.numel() * v.element_size()
        for s in state.values()
        for k, v in s.items()
        if isinstance(v, Tensor) and k != "step"
    )


def _memory(rank: int, numel: int, rounds: int) -> dict[str, Any]:
    """(b): each optimizer's bytes after one step, and its step time."""
    opts: dict[str, Any] = {}
    owned = 0
    for name in MEMORY:
        model = mlp(numel).to(BF16)
        params = list(model.parameters())
        g = torch.Generator().manual_seed(rank)
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(BF16)
        if name == TORCH_ZERO:
            opts[name] = TorchZero(params, torch.optim.AdamW, lr=1e-4)
        elif name == DDP_MAIN:
            opts[name] = _MainAdamW(params, lr=1e-4)
        else:
            main = torch.float32 if name == OURS_MAIN else None
            zero = ZeroRedundancyOptimizer(
                params, torch.optim.AdamW, lr=1e-4, partition="flat", main_params_dtype=main
            )
            owned = sum(s.stop - s.start for s in zero.ownership.owned(rank))
            opts[name] = zero
        opts[name].step()
    nbytes = {
        TORCH_ZERO: _state_bytes(opts[TORCH_ZERO].optim.state),
        OURS_MAIN: _state_bytes(opts[OURS_MAIN].state),
        OURS_PLAIN: _state_bytes(opts[OURS_PLAIN].state),
        DDP_MAIN: _state_bytes(opts[DDP_MAIN].optim.state)
        + sum(m.numel() * m.element_size() for m in opts[DDP_MAIN].main),
    }
    times: dict[str, list[float]] = {name: [] for name in MEMORY}
    for _ in range(rounds):
        for name in MEMORY:
            dist.barrier()
            t0 = time.perf_counter()
            opts[name].step()
            finish = getattr(opts[name], "finish_param_sync", None)
            if finish is not None:
                finish()
            times[name].append(time.perf_counter() - t0)
    return {
        "bytes": nbytes,
        "owned": owned,
        "median_s": {k: statistics.median(v) for k, v in times.items()},
    }


def _moved(rank: int, numel: int, reduce_dtype: torch.dtype | None) -> dict[str, int]:
    """(c): the buffer bytes of each kind of collective in one iteration (after two)."""
    model = mlp(numel).to(BF16)
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(),
        torch.optim.AdamW,
        lr=1e-4,
        partition="flat",
        main_params_dtype=torch.float32,
    )
    ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero, reduce_dtype=reduce_dtype))
    counter = ByteCounter()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(8, model[0].in_features, generator=g).to(BF16)
    for _ in range(3):
        counter.reset()
        with counter.counting():
            ddp(x).float().pow(2).mean().backward()
            zero.step()
            zero.finish_param_sync()
        zero.zero_grad()
    return dict(counter.buffers)


def _worker(rank: int, world_size: int, numel: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(max(1, 2 // world_size))
    out: dict[str, Any] = {"probe": {v: _probe(v, rank, world_size) for v in PROBE}}
    out.update(_memory(rank, numel, rounds))
    out["moved"] = {
        "bf16": _moved(rank, numel, None),
        "fp32": _moved(rank, numel, torch.float32),
    }
    out["total"] = sum(p.numel() for p in mlp(numel).parameters())
    return out


def _per_element(moved: dict[str, int], total: int) -> tuple[float, float, float]:
    # gradients: onto their owners (on gloo all-to-alls per buffer: comm.exchange)
    grads = sum(moved.get(op, 0) for op in ("reduce", "reduce_scatter", "all_to_all"))
    params = moved.get("broadcast", 0) + moved.get("all_gather", 0)
    other = sum(moved.values()) - grads - params
    return grads / total, params / total, other / total


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 ranks, 1M parameters, 3 rounds")
    ap.add_argument("--world-sizes", type=int, nargs="+")
    ap.add_argument("--numel", type=int, help="the bf16 model's parameters (4,000,000)")
    ap.add_argument("--rounds", type=int, help="timed step() calls per optimizer (10)")
    ap.add_argument("--json", help="also write the step-time rows as JSON to this path")
    args = ap.parse_args()
    world_sizes = args.world_sizes or ([2] if args.quick else [2, 3, 4])
    numel = args.numel or (1_000_000 if args.quick else 4_000_000)
    rounds = args.rounds or (3 if args.quick else 10)
    command = shlex.join(["python", "benchmarks/bench_main_params.py", *sys.argv[1:]])
    print(f"$ PYTHONPATH={os.environ.get('PYTHONPATH', '')} {command}")
    print(f"torch {torch.__version__}, gloo, {os.cpu_count()} CPU cores")
    rows: list[dict[str, Any]] = []
    for ws in world_sizes:
        results = run_ranks(_worker, ws, numel, rounds, timeout_s=1800)
        total = results[0]["total"]
        print(f"\n== {ws} ranks")
        n_probe = sum(p.numel() for p in _probe_model().parameters())
        print(
            f"(a) stagnation probe: bf16 MLP 64->128->64 ({n_probe:,} weights), AdamW "
            f"lr={PROBE_LR:g}, {PROBE_STEPS} steps, {PROBE_BATCH} rows per rank"
        )
        for v in PROBE:
            share = results[0]["probe"][v]
            print(f"  probe {PROBE_LABELS[v]:<50} weights changed {share:6.1%}")
        print(
            f"(b) optimizer bytes per rank after one step, bf16 MLP of {total:,} parameters "
            "(per-element state; the scalar step counters left out); B/element: per model "
            f"element; step ms: median of {rounds} step() calls, slowest rank"
        )
        print(
            f"  {'variant':<24}{'max/rank':>12}{'B/element':>11}{'x DDP+main':>12}"
            f"{'x torch ZeRO':>14}{'step ms':>9}  exact?"
        )
        worst = {v: max(r["bytes"][v] for r in results) for v in MEMORY}
        med = {v: max(r["median_s"][v] for r in results) for v in MEMORY}
        for v in MEMORY:
            exact = ""
            if v == OURS_MAIN:
                ok = all(r["bytes"][v] == 12 * r["owned"] for r in results)
                exact = f"bytes == 12 x owned on every rank: {ok}"
            elif v == DDP_MAIN:
                ok = all(r["bytes"][v] == 12 * total for r in results)
                exact = f"bytes == 12 x total on every rank: {ok}"
            line = (
                f"  {v:<24}{_mib(worst[v]):>12}{worst[v] / total:>11.3f}"
                f"{worst[v] / worst[DDP_MAIN]:>11.3f}x{worst[v] / worst[TORCH_ZERO]:>13.3f}x"
                f"{med[v] * 1e3:>9.1f}"
            )
            print(f"{line}  {exact}".rstrip())
        print(
            "(c) bytes moved per step by our collectives, reduce_scatter_hook + flat + "
            "main_params_dtype=torch.float32 (buffer bytes per model element, counted)"
        )
        print(f"  {'reduce_dtype':<14}{'gradients':>10}{'parameters':>11}{'other':>7}  by op")
        for label, key in (("None", "bf16"), ("torch.float32", "fp32")):
            per = [_per_element(r["moved"][key], total) for r in results]
            g, p, o = (max(x[i] for x in per) for i in range(3))
            ops = ", ".join(f"{k} {_mib(n)}" for k, n in sorted(results[0]["moved"][key].items()))
            print(f"  {label:<14}{g:>10.3f}{p:>11.3f}{o:>7.3f}  rank 0: {ops}")
        for v in MEMORY:
            rows.append(
                {
                    "benchmark": f"main params ({total / 1e6:.0f}M bf16 AdamW)",
                    "world_size": ws,
                    "variant": v,
                    "ms": med[v] * 1e3,
                    "vs_torch_best": med[v] / med[TORCH_ZERO],
                    "state_bytes": worst[v],
                }
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
