"""torchao's AdamW8bit compiled (its default, not ``force_eager``): ours under ``"flat"`` at 2
fake ranks against the plain optimizer, also compiled, on one 64 x 96 weight for 2 steps.

Prints the largest difference of parameters and dequantized ``exp_avg`` over the owned pieces
(measured: 0.0, bitwise). Kept out of ``make test``: compiling each piece shape takes ~25 s on
2 CPU cores. Run: ``python benchmarks/bench_lowbit_compiled.py``.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from zero_functional import ZeroRedundancyOptimizer
from zero_functional.comm.testing import fake_world
from zero_functional.core.layout import piece_view
from zero_functional.functional.registry import import_torchao

AdamW8bit = import_torchao("torchao.optim").AdamW8bit  # without its import's noise


def main() -> None:
    start = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g)
    grads = [torch.randn(64, 96, generator=g) for _ in range(2)]
    ref = nn.Parameter(w.clone())
    plain = AdamW8bit([ref], lr=1e-2)
    for grad in grads:
        ref.grad = grad.clone()
        plain.step()
    worst = 0.0
    for rank in range(2):
        with fake_world(2, rank):
            p = nn.Parameter(w.clone())
            zero = ZeroRedundancyOptimizer([p], AdamW8bit, partition="flat", lr=1e-2)
            for grad in grads:
                p.grad = grad.clone()
                zero.step()
            want = plain.state[ref]["exp_avg"].dequantize().reshape(-1)
            for s in zero.ownership.owned(rank):
                got = zero.state[p]["exp_avg"].dequantize().reshape(-1)
                worst = max(
                    worst,
                    (piece_view(p, s) - piece_view(ref, s)).abs().max().item(),
                    (got - want[s.start : s.stop]).abs().max().item(),
                )
    print(
        f"compiled AdamW8bit, flat, 2 ranks: max difference {worst} ({time.perf_counter() - start:.0f} s)"
    )


if __name__ == "__main__":
    main()
