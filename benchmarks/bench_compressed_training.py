"""Training with compressed collectives (issue 41): loss curves of fp32, bf16, fp8 and int8 wires.

Two jobs, each at ``--nproc`` ranks (4), each run four times from the same start on the same
batches: ``fp32`` (uncompressed: ``wire_dtype=None``, ``gather_dtype=None``) and ``bf16``,
``fp8`` (``torch.float8_e4m3fn``), ``int8``, each with ``wire_dtype`` (the gradients' reduce onto
their owners, :func:`~zero_functional.hooks.reduce_scatter_hook`) and ``gather_dtype`` (the
parameters' all-gather carries each step's change; the owners keep fp32 main copies) set to that
format, under ``partition="flat"``, stepping after backward:

* ``gpt``: a byte-level GPT (``_common.TinyGPT``: vocabulary 256, 4 blocks of width 96, context
  64; 0.48M parameters) on a real text available offline, the Python standard library's own
  sources (the top-level ``*.py`` files of ``sysconfig.get_paths()["stdlib"]``, sorted by name and
  concatenated: the first 90% train, the last 10% validate), AdamW (lr 2e-3, weight decay 0.1),
  a global batch of 32 random windows per step; final: the mean training loss of the last 20 steps
  and the validation loss (256 fixed windows);
* ``mlp``: the demo's job (``python -m zero_functional demo``: ``app/train.py``'s MLP 64 -> 128
  -> 128 -> 10 on scikit-learn's digits, Adam lr 1e-3, global batch 64, its seed's data order, its
  loss scaling); final: the test loss and accuracy.

The curves (the loss of each step, averaged over the ranks; and each run's difference from fp32)
go to ``--png``; the final losses are printed, and each run's wall time, only to size the job.

    PYTHONPATH=src python3 benchmarks/bench_compressed_training.py [--nproc 4] [--gpt-steps 500]
        [--mlp-epochs 20] [--jobs gpt mlp] [--png benchmarks/results/compressed_training.png]

``zero-functional bench`` passes ``--world-sizes``, ``--rounds``, ``--numel`` and ``--json``:
accepted and unused (nothing here is timed, so no row joins its summary).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import TinyGPT, add_untimed_flags, run_ranks, write_no_rows
from zero_functional.app.train import build_model, epoch_batches, load_digits_split, rank_slice
from zero_functional.hooks import reduce_scatter_hook
from zero_functional.optimizer import ZeroRedundancyOptimizer

VARIANTS: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "int8": torch.int8,
}
COLORS = {"fp32": "k", "bf16": "C1", "fp8": "C2", "int8": "C3"}
GPT = {"blocks": 4, "width": 96, "vocab": 256, "context": 64}
GPT_BATCH, GPT_LR, GPT_VAL, LAST = 32, 2e-3, 256, 20
MLP_BATCH, MLP_LR, MLP_HIDDEN, SEED = 64, 1e-3, 128, 0


def stdlib_text() -> tuple[Tensor, str]:
    """The top-level standard-library sources, concatenated, as bytes (uint8), and where from."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    data = b"".join(f.read_bytes() for f in files)
    where = f"{len(files)} files, {len(data):,} bytes of {root} (Python {sys.version.split()[0]})"
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), where


def _windows(text: Tensor, starts: Tensor, context: int) -> Tensor:
    """The ``context + 1`` bytes from each start, as token ids."""
    return torch.stack([text[s : s + context + 1] for s in starts.tolist()]).long()


def _zero(ddp: DDP, cls: type[torch.optim.Optimizer], dt: torch.dtype | None, **kw: Any) -> Any:
    """Our optimizer with both formats set to ``dt``, its hook registered on ``ddp``."""
    zero = ZeroRedundancyOptimizer(ddp.parameters(), cls, partition="flat", gather_dtype=dt, **kw)
    ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero, wire_dtype=dt))
    return zero


def _sum_over_ranks(value: Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item()


def _gpt_run(rank: int, world_size: int, dt: torch.dtype | None, text: Tensor, steps: int) -> Any:
    split = len(text) * 9 // 10
    train, val = text[:split], text[split:]
    context = GPT["context"]
    model = TinyGPT(**GPT)  # seeded
    ddp = DDP(model)
    zero = _zero(ddp, torch.optim.AdamW, dt, lr=GPT_LR, weight_decay=0.1)
    per = GPT_BATCH // world_size
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)  # the same global batch in every run
        starts = torch.randint(len(train) - context - 1, (GPT_BATCH,), generator=g)
        tokens = _windows(train, starts[rank * per : (rank + 1) * per], context)
        loss = TinyGPT.loss(ddp(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        zero.step()
        zero.zero_grad(set_to_none=True)
        losses.append(_sum_over_ranks(loss) / world_size)
    zero.finish_param_sync()
    g = torch.Generator().manual_seed(10**6)
    starts = torch.randint(len(val) - context - 1, (GPT_VAL,), generator=g)
    share = GPT_VAL // world_size
    tokens = _windows(val, starts[rank * share : (rank + 1) * share], context)
    with torch.no_grad():
        val_loss = _sum_over_ranks(TinyGPT.loss(model(tokens[:, :-1]), tokens[:, 1:])) / world_size
    final = sum(losses[-LAST:]) / len(losses[-LAST:])
    return {"curve": losses, "train": final, "val": val_loss}


def _mlp_run(
    rank: int, world_size: int, dt: torch.dtype | None, epochs: int, data: tuple[Tensor, ...]
) -> Any:
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(SEED)
    model = build_model(MLP_HIDDEN)
    ddp = DDP(model)
    zero = _zero(ddp, torch.optim.Adam, dt, lr=MLP_LR)
    losses = []
    for epoch in range(epochs):
        for batch in epoch_batches(len(y_train), MLP_BATCH, SEED, epoch):
            idx = rank_slice(batch, rank, world_size)
            loss = F.cross_entropy(ddp(x_train[idx]), y_train[idx], reduction="sum")
            (loss * (world_size / len(batch))).backward()  # DDP's average: the batch's mean
            zero.step()
            zero.zero_grad(set_to_none=True)
            losses.append(_sum_over_ranks(loss) / len(batch))
    zero.finish_param_sync()
    with torch.no_grad():
        logits = model(x_test)
        test_loss = F.cross_entropy(logits, y_test).item()
        accuracy = (logits.argmax(1) == y_test).float().mean().item()
    return {"curve": losses, "test": test_loss, "accuracy": accuracy}


def _worker(rank: int, world_size: int, job: str, text: Tensor | None, length: int) -> Any:
    out = {}
    data = load_digits_split() if job == "mlp" else ()  # (scikit-learn imports in seconds)
    for name, dt in VARIANTS.items():
        t0 = time.perf_counter()
        if job == "gpt":
            assert text is not None
            out[name] = _gpt_run(rank, world_size, dt, text, length)
        else:
            out[name] = _mlp_run(rank, world_size, dt, length, data)
        out[name]["s"] = time.perf_counter() - t0
    return out


def _plot(results: dict[str, Any], png: str, nproc: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {
        "gpt": "byte-level GPT on the Python stdlib (train loss)",
        "mlp": "demo MLP on digits (train loss)",
    }
    jobs = list(results)
    fig, axes = plt.subplots(2, len(jobs), figsize=(6.5 * len(jobs), 7.5), squeeze=False)
    for col, job in enumerate(jobs):
        top, bottom = axes[0][col], axes[1][col]
        base = torch.tensor(results[job]["fp32"]["curve"])
        for name in [*VARIANTS][::-1]:  # fp32 last, on top
            curve = torch.tensor(results[job][name]["curve"])
            steps = range(1, len(curve) + 1)
            top.plot(steps, curve.tolist(), COLORS[name], label=name, linewidth=1)
            if name != "fp32":
                diff = (curve - base).tolist()
                bottom.plot(steps, diff, COLORS[name], label=f"{name} - fp32", linewidth=0.8)
        top.set_title(f"{titles[job]}, {nproc} ranks")
        top.set_ylabel("loss")
        top.legend()
        bottom.axhline(0.0, color="black", linewidth=0.5)
        bottom.set_xlabel("step")
        bottom.set_ylabel("loss - fp32's loss, same step")
        bottom.legend()
    fig.suptitle("wire_dtype = gather_dtype = the variant's format; same start, same batches")
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--jobs", nargs="+", choices=["gpt", "mlp"], default=["gpt", "mlp"])
    ap.add_argument("--gpt-steps", type=int, default=500)
    ap.add_argument("--mlp-epochs", type=int, default=20)
    ap.add_argument("--png", help="draw the curves into this PNG")
    ap.add_argument("--world-sizes", type=int, nargs="+", help="ignored: the runs take --nproc")
    add_untimed_flags(ap)
    args = ap.parse_args()
    write_no_rows(args)
    print("$ python " + shlex.join(sys.argv), flush=True)
    results: dict[str, Any] = {}
    for job in args.jobs:
        if job == "gpt":
            text, where = stdlib_text()
            n = sum(p.numel() for p in TinyGPT(**GPT).parameters())
            print(f"\n== gpt: TinyGPT({GPT}), {n:,} parameters, on {where}")
            print(f"   AdamW lr {GPT_LR}, {args.gpt_steps} steps of {GPT_BATCH} windows")
            results[job] = run_ranks(
                _worker, args.nproc, job, text, args.gpt_steps, timeout_s=3600
            )[0]
            print(f"{'variant':<8} {'last 20 steps':>14} {'validation':>11} {'x fp32':>8}")
            base = results[job]["fp32"]["val"]
            for name, r in results[job].items():
                print(f"{name:<8} {r['train']:14.4f} {r['val']:11.4f} {r['val'] / base:8.4f}")
        else:
            steps = args.mlp_epochs * -(-1438 // MLP_BATCH)
            print(f"\n== mlp: the demo's MLP on digits, {args.mlp_epochs} epochs ({steps} steps)")
            results[job] = run_ranks(
                _worker, args.nproc, job, None, args.mlp_epochs, timeout_s=3600
            )[0]
            print(f"{'variant':<8} {'test loss':>10} {'accuracy':>9} {'x fp32':>8}")
            base = results[job]["fp32"]["test"]
            for name, r in results[job].items():
                print(f"{name:<8} {r['test']:10.4f} {r['accuracy']:9.4f} {r['test'] / base:8.4f}")
        took = ", ".join(f"{name} {r['s']:.0f} s" for name, r in results[job].items())
        print(f"(wall time per run, {args.nproc} ranks: {took})", flush=True)
    if args.png:
        _plot(results, args.png, args.nproc)
        print(f"\ncurves: {args.png}")


if __name__ == "__main__":
    main()
