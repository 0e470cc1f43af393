"""Time one in-place Adam update on 8M float32 params: foreach vs fused vs torch.optim.Adam."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from zero_functional.functional import adam_init, adam_update_

N_TENSORS, NUMEL, REPEATS, WARMUP = 8, 1 << 20, 15, 3


def _median_s(fn: Callable[[], None], device: torch.device) -> float:
    times = []
    for i in range(WARMUP + REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    params = [torch.randn(NUMEL, device=device) for _ in range(N_TENSORS)]
    grads = [torch.randn_like(p) for p in params]
    results: dict[str, float] = {}
    for fused in (False, True):
        ps = [p.clone() for p in params]
        state = adam_init(ps)
        results[f"zero_functional fused={fused}"] = _median_s(
            lambda ps=ps, state=state, fused=fused: adam_update_(
                ps, grads, state, lr=1e-3, fused=fused
            ),
            device,
        )
    tparams = [nn.Parameter(p.clone()) for p in params]
    for p, g in zip(tparams, grads):
        p.grad = g
    opt = torch.optim.Adam(tparams, lr=1e-3)
    results["torch.optim.Adam default"] = _median_s(lambda: opt.step(), device)
    base = results["torch.optim.Adam default"]
    print(
        f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} "
        f"params={N_TENSORS}x{NUMEL} median of {REPEATS}"
    )
    for name, t in results.items():
        print(f"{name:32s} {t * 1e3:9.2f} ms   {t / base:5.2f}x torch default")


if __name__ == "__main__":
    main()
