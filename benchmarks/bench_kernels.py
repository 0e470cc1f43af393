"""One in-place optimizer step on 8M float32 parameters in 8 tensors: every kernel, one process.

Adam: torch.optim.Adam with its CPU default (the for-loop), with foreach=True and with
fused=True; ours through ``adam_update_`` with fused=False (foreach: torch's default numerics),
at its default (torch's fused kernel where it applies) and with compile=True. SGD with
momentum 0.9: the same torch variants, ours (foreach, the only eager path) and ours compiled.
Variants run interleaved, round by round, so that they share the machine's state; each owns its
params and state, the grads are shared. Prints median milliseconds, each variant's time over
torch's best and over torch's fused (below 1 is faster), and the compiled variants' warm-up
(tracing and compiling, or loading inductor's on-disk cache) separately: what
``functional.compile_policy`` is decided from.

    python benchmarks/bench_kernels.py [--rounds 30] [--numel 8388608] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from _common import torch_step
from zero_functional.functional import adam_init, adam_update_, sgd_init, sgd_update_

N_TENSORS = 8
Step = Callable[[], None]


def _our_step(
    update: Callable[..., None],
    init: Callable[[list[torch.Tensor]], object],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    **kw: object,
) -> Step:
    ps = [p.clone() for p in params]
    state = init(ps)
    return lambda: update(ps, grads, state, lr=1e-3, **kw)


def _variants(params: list[torch.Tensor], grads: list[torch.Tensor]) -> dict[str, dict[str, Step]]:
    adam, sgd = torch.optim.Adam, torch.optim.SGD
    return {
        "Adam": {
            "torch default (for-loop)": torch_step(adam, params, grads, lr=1e-3),
            "torch foreach": torch_step(adam, params, grads, lr=1e-3, foreach=True),
            "torch fused": torch_step(adam, params, grads, lr=1e-3, fused=True),
            "ours foreach": _our_step(adam_update_, adam_init, params, grads, fused=False),
            "ours fused (default)": _our_step(adam_update_, adam_init, params, grads),
            "ours compiled": _our_step(adam_update_, adam_init, params, grads, compile=True),
        },
        "SGD momentum": {
            "torch default (for-loop)": torch_step(sgd, params, grads, lr=1e-3, momentum=0.9),
            "torch foreach": torch_step(sgd, params, grads, lr=1e-3, momentum=0.9, foreach=True),
            "torch fused": torch_step(sgd, params, grads, lr=1e-3, momentum=0.9, fused=True),
            "ours foreach (default)": _our_step(sgd_update_, sgd_init, params, grads, momentum=0.9),
            "ours compiled": _our_step(
                sgd_update_, sgd_init, params, grads, momentum=0.9, compile=True
            ),
        },
    }


def _time(steps: dict[str, Step], rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds of two warm-up calls (for the compiled variants: tracing and compiling; SGD's
    first step, which makes the momentum buffers, is another graph), median seconds."""
    warmup = dict.fromkeys(steps, 0.0)
    for _ in range(2):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            warmup[name] += time.perf_counter() - t0
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return warmup, {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--numel", type=int, default=N_TENSORS << 20, help="total, in 8 tensors")
    ap.add_argument("--world-sizes", type=int, nargs="*", help="ignored: one process")
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    args = ap.parse_args()
    torch.manual_seed(0)
    size = max(1, args.numel // N_TENSORS)
    params = [torch.randn(size) for _ in range(N_TENSORS)]
    grads = [torch.randn(size) for _ in range(N_TENSORS)]
    print(
        f"{N_TENSORS} x {size:,} float32, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds"
    )
    rows = []
    for optimizer, steps in _variants(params, grads).items():
        first, med = _time(steps, args.rounds)
        best_name = min((n for n in steps if n.startswith("torch")), key=med.__getitem__)
        best, fused = med[best_name], med["torch fused"]
        print(f"\n== {optimizer} step; torch best is {best_name}")
        print(f"{'variant':<26}{'ms':>9}{'x torch best':>14}{'x torch fused':>15}")
        for name in steps:
            print(
                f"{name:<26}{med[name] * 1e3:>9.2f}{med[name] / best:>13.2f}x"
                f"{med[name] / fused:>14.2f}x"
            )
            row: dict[str, object] = {
                "benchmark": f"{optimizer} kernel ({N_TENSORS * size / 1e6:.1f}M fp32)",
                "world_size": 1,
                "variant": name,
                "ms": med[name] * 1e3,
                "vs_torch_best": med[name] / best,
            }
            if name == "ours compiled":
                row["compile_s"] = first[name]
            rows.append(row)
        print(f"ours compiled: warm-up (trace, compile, 2 steps) {first['ours compiled']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
