"""Compressed gradient reduction (issue 41): the owner's reduced gradient against the exact average.

Every rank computes its gradient of one model on its own random batch; the exact average is the
float64 mean of every rank's fp32 gradient (all-gathered, no rounding on the way). Then, from the
same start and on the same batches, each variant reduces the gradients, and this script compares
what it left against the exact average, element by element:

* ``ours, wire_dtype=D``: DDP + :func:`~zero_functional.hooks.reduce_scatter_hook` with
  ``wire_dtype=D`` on ``ZeroRedundancyOptimizer(partition="flat")``: each rank's contribution to
  an owner's stretch crosses in ``D`` (rounded once; the owner's own contribution does not cross),
  the owner sums in fp32 in rank order. Compared on the pieces each rank owns (they tile the
  gradient); ``D = None`` is the uncompressed fp32 path.
* ``DDP``: DDP's own fp32 all-reduce; ``DDP + fp16_compress_hook``: torch's hook (divide by the
  world size, cast to fp16, all-reduce in fp16, cast back), so each partial sum of gloo's
  all-reduce is rounded to fp16 again. Compared on the whole gradient of every rank.
* ``DDP + bf16_compress_hook``: torch refuses to register it without CUDA/NCCL or XPU (the
  message is printed); the row ``(unchecked)`` runs torch's own function through a wrapper whose
  name DDP's check does not know, to show what its bf16 all-reduce does on gloo.

Columns: the largest and the mean ``|reduced - exact|``, and both over the RMS of the exact
average gradient. The claim it checks: ``wire_dtype=torch.float16`` is no less exact than DDP +
``fp16_compress_hook``, max and mean, at every world size. No timing: 8 ranks on 2 cores are fine.

Models (``--models``): ``mlp`` = 8 x Linear(512, 512) + ReLU (2.1M elements), the mean squared
error against a random target on 32 random rows per rank; ``gpt`` = ``_common.TinyGPT()``
(2.9M elements, 77 tensors), the next-token loss on 8 random sequences of 64 tokens per rank.

    PYTHONPATH=src python3 benchmarks/bench_compressed_error.py [--world-sizes 2 4 8]
        [--models mlp gpt]

``zero-functional bench`` passes ``--world-sizes`` (used) and ``--rounds``, ``--numel``,
``--json`` (accepted: nothing here is timed, so no row joins its summary).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import TinyGPT, add_untimed_flags, gpt_batch, mlp, run_ranks, write_no_rows
from zero_functional.hooks import reduce_scatter_hook
from zero_functional.optimizer import ZeroRedundancyOptimizer

WIRE: dict[str, torch.dtype | None] = {
    "ours, wire_dtype=None (fp32)": None,
    "ours, wire_dtype=torch.bfloat16": torch.bfloat16,
    "ours, wire_dtype=torch.float16": torch.float16,
    "ours, wire_dtype=torch.int8": torch.int8,
    "ours, wire_dtype=torch.float8_e4m3fn": torch.float8_e4m3fn,
}
DDP_FP32 = "DDP (fp32 all-reduce)"
DDP_FP16 = "DDP + fp16_compress_hook"
DDP_BF16 = "DDP + bf16_compress_hook (unchecked)"
OURS_FP16 = "ours, wire_dtype=torch.float16"
DDP_HOOKS: dict[str, Callable[..., Any] | None] = {
    DDP_FP32: None,
    DDP_FP16: default_hooks.fp16_compress_hook,
    # torch's own function, under a name DDP's registration check does not refuse on CPU
    DDP_BF16: lambda state, bucket: default_hooks.bf16_compress_hook(state, bucket),
}
MODELS = {"mlp": "8 x Linear(512, 512)", "gpt": "TinyGPT (6 blocks, width 192)"}


def _model(name: str) -> nn.Module:
    return mlp(8 * 512 * 512, width=512) if name == "mlp" else TinyGPT()


def _backward(model: nn.Module, name: str, rank: int) -> None:
    """This rank's loss on its own batch (seeded by the rank), then backward."""
    if name == "mlp":
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(32, 512, generator=g), torch.randn(32, 512, generator=g)
        F.mse_loss(model(x), y).backward()
    else:
        tokens = gpt_batch(rank)
        TinyGPT.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()


def _flat_grads(model: nn.Module) -> Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _errors(got: Tensor, exact: Tensor) -> tuple[float, float, int]:
    """The largest and summed ``|got - exact|`` (in float64), and how many elements."""
    err = (got.double() - exact).abs()
    return err.max().item(), err.sum().item(), err.numel()


def _bf16_refusal() -> str:
    """What DDP says when torch's bf16_compress_hook is registered here."""
    ddp = DDP(nn.Linear(2, 2))
    try:
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    except Exception as e:  # noqa: BLE001  # the message is the measurement
        return f"{type(e).__name__}: {e}"
    return "registered"


def _worker(rank: int, world_size: int, name: str) -> dict[str, Any]:
    model = _model(name)
    _backward(model, name, rank)
    mine = _flat_grads(model)
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    exact = torch.stack(every).double().mean(dim=0)  # the exact average, rounded only in float64
    del every
    out: dict[str, Any] = {"numel": exact.numel(), "rms": exact.pow(2).mean().sqrt().item()}
    for variant, wire in WIRE.items():
        model = _model(name)
        ddp = DDP(model)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.0, partition="flat")
        ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero, wire_dtype=wire))
        _backward(ddp, name, rank)
        params = zero.param_table.params  # model.parameters()'s order, as ``exact``'s
        offsets = [sum(p.numel() for p in params[:k]) for k in range(len(params))]
        got, where = [], []
        for s in zero.ownership.owned(rank):
            got.append(params[s.param].grad.flatten()[s.start : s.stop])
            where.append(torch.arange(s.start, s.stop) + offsets[s.param])
        out[variant] = _errors(torch.cat(got), exact[torch.cat(where)])
    for variant, hook in DDP_HOOKS.items():
        model = _model(name)
        ddp = DDP(model)
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        try:
            _backward(ddp, name, rank)
        except Exception as e:  # noqa: BLE001  # a hook gloo cannot run: said in its row
            out[variant] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            continue
        out[variant] = _errors(_flat_grads(model), exact)
    out["bf16 refusal"] = _bf16_refusal()
    return out


def _report(name: str, world_size: int) -> dict[str, tuple[float, float]]:
    results = run_ranks(_worker, world_size, name, timeout_s=1800)
    numel, rms = results[0]["numel"], results[0]["rms"]
    print(
        f"\n== {MODELS[name]}, {numel:,} gradient elements, {world_size} ranks: "
        f"|reduced - exact average|, gradient RMS {rms:.3e}"
    )
    print(f"{'variant':<40} {'max abs':>10} {'mean abs':>10} {'max/RMS':>10} {'mean/RMS':>10}")
    rows: dict[str, tuple[float, float]] = {}
    for variant in [*WIRE, *DDP_HOOKS]:
        failed = [r[variant] for r in results if isinstance(r[variant], str)]
        if failed:
            print(f"{variant:<40} does not run: {failed[0]}")
            continue
        top = max(r[variant][0] for r in results)
        total = sum(r[variant][1] for r in results)
        count = sum(r[variant][2] for r in results)
        # ours: the owned pieces tile the gradient once; DDP: every rank holds all of it
        assert count == numel * (1 if variant in WIRE else world_size), (variant, count)
        mean = total / count
        rows[variant] = (top, mean)
        print(f"{variant:<40} {top:10.3e} {mean:10.3e} {top / rms:10.3e} {mean / rms:10.3e}")
    print(f"torch's bf16_compress_hook, registered: {results[0]['bf16 refusal']}")
    (ours_max, ours_mean), (ddp_max, ddp_mean) = rows[OURS_FP16], rows[DDP_FP16]
    holds = ours_max <= ddp_max and ours_mean <= ddp_mean
    print(
        f"wire_dtype=torch.float16 / DDP + fp16_compress_hook: max {ours_max / ddp_max:.2f}x, "
        f"mean {ours_mean / ddp_mean:.2f}x: no less exact: {'yes' if holds else 'NO'}"
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    add_untimed_flags(ap)
    args = ap.parse_args()
    write_no_rows(args)
    print("$ python " + shlex.join(sys.argv), flush=True)
    summary = []
    for name in args.models:
        for ws in args.world_sizes:
            rows = _report(name, ws)
            summary.append((name, ws, rows[OURS_FP16], rows[DDP_FP16]))
            sys.stdout.flush()
    print("\n== wire_dtype=torch.float16 against DDP + fp16_compress_hook (max, mean |error|)")
    print(
        f"{'model':<32} {'ranks':>5} {'ours max':>10} {'DDP max':>10} {'ours mean':>10} "
        f"{'DDP mean':>10}"
    )
    for name, ws, (om, oa), (dm, da) in summary:
        print(f"{MODELS[name]:<32} {ws:>5} {om:10.3e} {dm:10.3e} {oa:10.3e} {da:10.3e}")


if __name__ == "__main__":
    main()
