"""overlap_param_gather: step() returns with the all-gather in flight; each forward waits for every
parameter under it; results equal DDP + the unsharded optimizer in every mode; each read the
README lists waits or is named."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from zero_functional.hooks import hook_with_zero_step_interleaved, reduce_scatter_hook
from zero_functional.optimizer import ZeroRedundancyOptimizer

from tests.helpers import FUSED, max_diff, run_ranks


class Tied(nn.Module):
    """Large enough that weights travel alone (not packed), with a layer used twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(300, 300)
        self.b = nn.Linear(300, 300)
        self.out = nn.Linear(300, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.b(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def _worker(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for mode in ("step", "step bucket view", "overlap"):
        for partition in ("sorted_greedy", "flat"):
            name = f"{mode} {partition}"
            model, ref_model = Tied(), Tied()
            ddp, ref = DDP(model, bucket_cap_mb=0.2), DDP(ref_model, bucket_cap_mb=0.2)
            zero = ZeroRedundancyOptimizer(
                ddp.parameters(),
                torch.optim.Adam,
                overlap_with_ddp=mode == "overlap",
                parameters_as_bucket_view="bucket" in mode,
                partition=partition,
                overlap_param_gather=True,
                lr=0.01,
            )
            if mode == "overlap":
                ddp.register_comm_hook(
                    None, hook_with_zero_step_interleaved(allreduce_hook, ddp, zero)
                )
            else:
                ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
            plain = torch.optim.Adam(ref.parameters(), lr=0.01, **FUSED)
            losses: list[tuple[float, float]] = []
            for step in range(5):
                g = torch.Generator().manual_seed(10 * step + rank)
                x, y = torch.randn(4, 300, generator=g), torch.randn(4, 3, generator=g)
                pair = []
                for d, o in ((ddp, zero), (ref, plain)):
                    o.zero_grad()
                    loss = ((d(x) - y) ** 2).mean()  # the forward waits for its parameters
                    loss.backward()
                    if o is plain or mode != "overlap":
                        o.step()
                    pair.append(loss.item())
                losses.append((pair[0], pair[1]))
            out[f"{name} losses"] = max(abs(a - b) for a, b in losses)
            zero.finish_param_sync()
            out[name] = max(
                (a - b).abs().max().item()
                for a, b in zip(model.parameters(), ref_model.parameters())
            )
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            gathered = [torch.zeros_like(flat) for _ in range(world_size)]
            dist.all_gather(gathered, flat)
            out[f"{name} ranks identical"] = max((v - flat).abs().max().item() for v in gathered)
    return out


def test_parameters_gathered_during_the_next_forward_equal_ddp() -> None:
    for result in run_ranks(_worker, 2, timeout_s=240):
        for name, diff in result.items():
            # Both sides average the same gradients (two ranks: a sum of two, either order) and run
            # the same kernels (a reference Adam is FUSED, the kernel ours runs; SGD and the rest
            # run torch's own on both), so they differ only where a piece cut off a tensor puts
            # elements in a kernel's scalar tail rather than its vector body: a few ulps of an
            # update per step, which move a parameter by one ulp of itself only where they cross a
            # rounding boundary: at most 5 steps x ulp(|p| < 1) = 3e-7 < 1e-6 (these layers start
            # below 0.06). The losses: the same forward on parameters at most that far apart.
            assert diff < 1e-6, (name, diff)


def _readers_worker(rank: int, world_size: int) -> Any:
    """The package's own readers wait: step() before updating, with and without bucket views."""
    out = {}
    for bucket_view in (False, True):
        torch.manual_seed(0)
        model = Tied()
        initial = [p.detach().clone() for p in model.parameters()]
        zero = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.SGD,
            lr=0.1,
            overlap_param_gather=True,
            parameters_as_bucket_view=bucket_view,
        )
        for step in range(3):
            for p in model.parameters():
                p.grad = torch.full_like(p, float(step + 1))
            zero.step()  # no forward in between: step() itself waits for the previous all-gather
        zero.finish_param_sync()
        zero.finish_param_sync()  # idempotent
        # plain SGD: every step's update arrived, on every rank, owned here or not
        out[bucket_view] = max(
            (p.detach() - (p0 - 0.1 * (1 + 2 + 3))).abs().max().item()
            for p, p0 in zip(model.parameters(), initial)
        )
    return out


def test_steps_without_forwards_in_between_still_end_equal() -> None:
    for result in run_ranks(_readers_worker, 2, timeout_s=120):
        for bucket_view, diff in result.items():
            # plain SGD on constant gradients: p0 - 0.1 x 6 in three roundings (|p| < 1): 1.8e-7.
            assert diff < 1e-6, (bucket_view, diff)


class HeadFirst(nn.Module):
    """The parent reads ``head.weight`` before ``body`` runs (small: one unit carries both)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.head.weight * 1.0  # read before any child runs
        return F.linear(self.body(x), w, self.head.bias)


def _train(
    rank: int, mode: str, partition: str, compile_: str = ""
) -> tuple[float, nn.Module, Any]:
    """5 steps of ``HeadFirst`` under DDP + ours (``overlap_param_gather=True``) and DDP + Adam;
    ``compile_``: ``"wrapper"`` (``torch.compile(ddp)``) or ``"in place"`` (``ddp.compile()``),
    aot_eager. The largest parameter difference, our model and optimizer."""
    model, ref_model = HeadFirst(), HeadFirst()
    ddp, ref = DDP(model), DDP(ref_model)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(),
        torch.optim.Adam,
        overlap_with_ddp=mode == "overlap",
        partition=partition,
        overlap_param_gather=True,
        lr=0.05,
    )
    if mode == "overlap":
        ddp.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, ddp, zero))
    else:
        ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
    run: nn.Module = ddp
    if compile_ == "wrapper":
        run = torch.compile(ddp, backend="aot_eager")  # type: ignore[assignment]
    elif compile_ == "in place":
        ddp.compile(backend="aot_eager")
    plain = torch.optim.Adam(ref.parameters(), lr=0.05, **FUSED)
    for step in range(5):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        for d, o in ((run, zero), (ref, plain)):
            o.zero_grad()
            ((d(x) - y) ** 2).mean().backward()
            if o is plain or mode != "overlap":
                o.step()
    zero.finish_param_sync()
    return max_diff(model, ref_model), model, zero


def _reads_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Every read the README lists, each with a parameter in flight: the parent's forward before
    its children (waits), a compiled forward (waits: its wrapper's hook runs eagerly; in place:
    the read is named at backward), ``state_dict()`` (waits), a read outside any forward
    (named at backward)."""
    out: dict[str, Any] = {}
    for mode in ("step", "overlap"):
        for partition in ("sorted_greedy", "flat"):
            out[f"parent reads first {mode} {partition}"] = _train(rank, mode, partition)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.compile(module) warns of global hooks
        out["compiled wrapper"] = _train(rank, "step", "flat", "wrapper")[0]
        try:
            _train(rank, "step", "flat", "in place")
            out["compiled in place"] = "no error"
        except RuntimeError as e:
            out["compiled in place"] = str(e)
    torch._dynamo.reset()
    model = HeadFirst()
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, lr=0.1, overlap_param_gather=True
    )
    model(torch.zeros(1, 6))  # nothing in flight: learns the names
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    zero.step()  # leaves the all-gather in flight
    sd = model.head.state_dict()  # a child's state_dict waits
    out["state_dict waits"] = max(
        (v - model.head.state_dict()[k]).abs().max().item() for k, v in sd.items()
    )
    zero.step()  # in flight again
    try:
        model.head.weight.sum().backward()  # read outside any forward
        out["read outside a forward"] = "no error"
    except RuntimeError as e:
        out["read outside a forward"] = str(e)
    zero.finish_param_sync()
    return out


def test_every_read_of_a_parameter_in_flight_waits_or_is_named() -> None:
    for result in run_ranks(_reads_worker, 2, timeout_s=120):
        for name, value in result.items():
            if name == "read outside a forward":
                assert "'head.weight'" in value and "finish_param_sync()" in value, value
            elif name == "compiled in place":  # no eager forward ran: named by its index
                assert "parameter 4 of the optimizer (3, 6)" in value, value
            else:
                # Both sides average the same gradients (two ranks: a sum of two, either order)
                # and run the same kernel (FUSED), so they differ only where a piece puts elements
                # in its scalar tail: a few ulps of an update, one ulp of a parameter (<= 6e-8
                # below |p| = 1) where that crosses a rounding boundary, 5 steps: 3e-7. A read
                # that waited ("state_dict waits") is the gathered value itself: 0.
                assert value < 1e-6, (name, value)
