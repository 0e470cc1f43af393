"""Issue 22's byte facts, counted from the collectives that ran, and its benchmark end to end.

With ``reduce_scatter_hook`` + ``partition="flat"`` + ``main_params_dtype=torch.float32`` on a
bf16 model, the parameter all-gather moves 2 bytes per element (the owners' pieces are rounded
to bf16 before they are sent), and ``reduce_dtype=torch.float32`` doubles only the gradient half.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from zero_functional.hooks import reduce_scatter_hook
from zero_functional.optimizer import ZeroRedundancyOptimizer

from tests.helpers import run_ranks, run_script

BF16 = torch.bfloat16
# each collective our comm layer may call (looked up on torch.distributed when called), and which
# positional argument is the buffer it covers: the whole output of a gather, the whole input of a
# reduce-scatter, the tensor of the others
COUNTED = {
    "reduce": ("gradients", 0),
    "all_to_all_single": ("gradients", 1),  # gloo's reduce onto owners (comm.exchange)
    "reduce_scatter_tensor": ("gradients", 1),
    "reduce_scatter_single": ("gradients", 1),
    "broadcast": ("parameters", 0),
    "all_gather_into_tensor": ("parameters", 0),
    "all_gather_single": ("parameters", 0),
    "all_reduce": ("other", 0),
}


def _counted(moved: dict[str, int], half: str, arg: int, fn: Callable[..., Any]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = args[arg]
        covered = t.numel() * t.element_size()
        if fn.__name__ == "all_to_all_single":  # the others' stretches sent, plus this rank's
            # own, which arrive from each of the others (2 ranks: the received, once)
            received = args[0]
            others = dist.get_world_size(kwargs.get("group")) - 1
            covered += received.numel() * received.element_size() // others
        moved[half] = moved.get(half, 0) + covered
        return fn(*args, **kwargs)

    return wrapper


def _bytes_worker(rank: int, world_size: int) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for label, reduce_dtype in (("bf16", None), ("fp32", torch.float32)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(BF16)
        ddp = DDP(model)
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(),
            torch.optim.AdamW,
            lr=1e-4,
            partition="flat",
            main_params_dtype=torch.float32,
        )
        ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero, reduce_dtype=reduce_dtype))
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank)).to(BF16)
        for _ in range(3):  # the last iteration counted, after DDP has settled its buckets
            moved: dict[str, int] = {}
            originals = {op: getattr(dist, op) for op in COUNTED if hasattr(dist, op)}
            for op, fn in originals.items():
                setattr(dist, op, _counted(moved, *COUNTED[op], fn))
            try:
                ddp(x).float().pow(2).mean().backward()
                zero.step()
                zero.finish_param_sync()
            finally:
                for op, fn in originals.items():
                    setattr(dist, op, fn)
            zero.zero_grad()
        out[label] = {**moved, "elements": sum(p.numel() for p in model.parameters())}
    return out


def test_gather_moves_2_bytes_per_bf16_element_and_reduce_dtype_doubles_only_gradients() -> None:
    for r in run_ranks(_bytes_worker, 2, timeout_s=120):
        bf16, fp32 = r["bf16"], r["fp32"]
        n = bf16["elements"]
        assert bf16 == {"gradients": 2 * n, "parameters": 2 * n, "elements": n}, bf16
        assert fp32 == {"gradients": 4 * n, "parameters": 2 * n, "elements": n}, fp32


def _number(pattern: str, out: str) -> float:
    match = re.search(pattern, out)
    assert match, (pattern, out)
    return float(match.group(1))


@pytest.mark.bench  # the benchmark end to end (about 10 s on 2 cores): make bench runs it
def test_bench_main_params_quick_shows_the_issues_numbers() -> None:
    proc = run_script("benchmarks/bench_main_params.py", "--quick")
    out = proc.stdout
    assert proc.returncode == 0, (out[-3000:], proc.stderr[-3000:])
    assert out.startswith("$ PYTHONPATH=")  # the exact command first
    main = _number(r"main_params_dtype=torch.float32 +weights changed +([\d.]+)%", out)
    reference = _number(r"fp32 main weights \+ torch.optim.AdamW +weights changed +([\d.]+)%", out)
    plain = _number(r"torch ZeroRedundancyOptimizer .* +weights changed +([\d.]+)%", out)
    assert main >= 80 and reference >= 80 and plain < 50, out
    assert "bytes == 12 x owned on every rank: True" in out, out
    assert "bytes == 12 x total on every rank: True" in out, out
    assert _number(r"ours flat, main fp32 +[\d.]+ MiB +([\d.]+)", out) == pytest.approx(6.0, 1e-3)
    # (c): gradients, parameters, other, in bytes per element
    assert re.search(r"\n  None +2\.000 +2\.000 +0\.000 ", out), out
    assert re.search(r"\n  torch\.float32 +4\.000 +2\.000 +0\.000 ", out), out
