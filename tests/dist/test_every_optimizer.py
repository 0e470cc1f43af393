"""Every elementwise torch.optim class in every mode, and GradScaler in overlap mode (issue #12).

Against the unsharded reference: DDP + the same ``torch.optim`` class, same data, same seeds.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from zero_functional.hooks import (
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    overlap_state,
    reduce_scatter_hook,
)
from zero_functional.optimizer import ZeroRedundancyOptimizer

from tests.helpers import FUSED, max_diff, ours_kernel, reduced_grads, run_ranks, train_both

ATOL = 1e-6

CLASSES: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    (torch.optim.Adam, {"lr": 0.01, "maximize": True}),
    (torch.optim.AdamW, {"lr": 0.01, "amsgrad": True}),
    (torch.optim.Adamax, {"lr": 0.01, "foreach": True}),
    (torch.optim.NAdam, {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.01}),
    (torch.optim.RAdam, {"lr": 0.01}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True, "foreach": False}),
    (torch.optim.Rprop, {"lr": 0.01, "maximize": True}),
    (torch.optim.Adagrad, {"lr": 0.05, "initial_accumulator_value": 0.1}),
    (torch.optim.Adadelta, {"lr": 0.5}),
    (torch.optim.ASGD, {"lr": 0.01, "t0": 2}),
]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 12)
        self.b = nn.Linear(12, 12)
        self.c = nn.Linear(12, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def backward(module: nn.Module, rank: int, world_size: int, step: int) -> None:
    x, y = batch(rank, step)
    ((module(x) - y) ** 2).mean().backward()


def groups(model: nn.Module, lr: float) -> list[dict[str, Any]]:
    return [
        {"params": list(model.a.parameters()) + list(model.c.parameters())},
        {"params": list(model.b.parameters()), "lr": lr / 2},
    ]


def params_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """``opt``'s parameters in its groups' order (our optimizer's global index order)."""
    return [p for g in opt.param_groups for p in g["params"]]


def shadow_step(shadow: torch.optim.Optimizer, zero: Any, rank: int) -> None:
    """Step ``shadow`` on the gradients ``zero``'s run reduced (every owner's pieces, put
    together); collective."""
    for p, g in zip(params_of(shadow), reduced_grads(zero, rank), strict=True):
        p.grad = g
    shadow.step()


def _classes_worker(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for cls, kw in CLASSES:
        for partition in ("sorted_greedy", "flat"):
            for overlap in (False, True):
                name = f"{cls.__name__} {partition} overlap={overlap}"
                model, ref_model = Net(), Net()
                ddp, ref = DDP(model, bucket_cap_mb=1e-3), DDP(ref_model, bucket_cap_mb=1e-3)
                zero = ZeroRedundancyOptimizer(
                    groups(model, kw["lr"]),
                    cls,
                    overlap_with_ddp=overlap,
                    partition=partition,
                    **kw,
                )
                if overlap:
                    ddp.register_comm_hook(
                        None, hook_with_zero_step_interleaved(allreduce_hook, ddp, zero)
                    )
                else:
                    ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
                plain = cls(groups(ref_model, kw["lr"]), **kw, **ours_kernel(cls))
                # the state's reference: the class stepped on the very gradients our run reduced
                # (at 3 ranks DDP's all-reduce adds them in another order: the bound below)
                shadow = cls(groups(Net(), kw["lr"]), **kw, **ours_kernel(cls))
                scheds = [
                    torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
                    for o in (zero, plain, shadow)
                ]

                def backward_and_shadow(
                    module: nn.Module,
                    rank: int,
                    world_size: int,
                    step: int,
                    mine: tuple[Any, ...] = (ddp, zero, shadow),
                ) -> None:
                    backward(module, rank, world_size, step)
                    if module is mine[0]:
                        shadow_step(mine[2], mine[1], rank)

                # (overlap mode steps inside backward: the schedulers' warning is wrong)
                train_both(
                    [(ddp, zero), (ref, plain)], rank, world_size, 4, backward_and_shadow, scheds
                )
                out[name] = max_diff(model, ref_model)
                # the state dict is torch's format for the class: it loads into a plain one
                zero.consolidate_state_dict(to=0)
                if rank == 0:
                    sd = zero.state_dict()
                    copy_m = copy.deepcopy(ref_model)
                    fresh = cls(groups(copy_m, kw["lr"]), **kw)
                    fresh.load_state_dict(copy.deepcopy(sd))
                    # paired by parameter: a missing or extra state entry fails, not vanishes
                    pairs = list(zip(params_of(fresh), params_of(shadow), strict=True))
                    assert [q in fresh.state for q, _ in pairs] == [
                        r in shadow.state for _, r in pairs
                    ], name
                    out[f"{name} state"] = 0.0
                    for q, r in pairs:
                        s_ours, s_ref = fresh.state.get(q, {}), shadow.state.get(r, {})
                        assert set(s_ours) == set(s_ref), (name, set(s_ours), set(s_ref))
                        for k, v in s_ref.items():
                            if isinstance(v, torch.Tensor):
                                # relative to the tensor's scale (centered RMSprop's buffers
                                # reach 1e1 in a few steps); the bound: the test's comment
                                diff = (s_ours[k].double() - v.double()).abs().max().item()
                                scale = max(1.0, v.abs().max().item())
                                out[f"{name} state"] = max(
                                    out.get(f"{name} state", 0.0), diff / scale
                                )
    return out


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()`")
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_elementwise_class_in_every_mode_equals_ddp_with_that_class(world_size: int) -> None:
    # The parameters, against DDP + the class (an Adam on FUSED, the kernel ours runs; the
    # rest on torch's own kernels, as ours). At 2 ranks an average is the same sum of two in
    # either order, so they differ only where a piece puts elements in a kernel's scalar tail
    # rather than its vector body: a few ulps of an update per step, which move a parameter one
    # ulp of itself (<= 6e-8 below |p| = 1) where they cross a rounding boundary: 4 x 6e-8. At
    # 3 ranks DDP's all-reduce and our reduce add the gradients in other orders: an average
    # differs by at most 2 u kappa of itself (u = 2^-24; kappa = sum |g_r| / |sum g_r|, the
    # seeded data's, not the machine's); an update (at most 0.05 in size for every class here)
    # is a ratio of gradient statistics and moves by at most twice that relative change:
    # 4 steps x 2 x 0.05 x 2 u kappa = 4.8e-8 kappa, below ATOL while kappa < 20.
    # The state, against the class stepped on our own reduced gradients (the same inputs, the
    # same kernels): at most one ulp (2^-23 of its scale) per step, 4 x 2^-23 < ATOL.
    for rank_result in run_ranks(_classes_worker, world_size, timeout_s=600):
        for name, diff in rank_result.items():
            assert diff < ATOL, (name, world_size, diff)


# ---------------------------------------------------------------- what overlap mode refuses


def _kinds_worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = Net()
    with pytest.raises(ValueError) as info:
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.LBFGS, overlap_with_ddp=True)
    out["LBFGS"] = str(info.value)
    # a per-tensor class without a closure runs whole tensors in overlap mode
    model, ref_model = Net(), Net()
    ddp, ref = DDP(model, bucket_cap_mb=1e-3), DDP(ref_model, bucket_cap_mb=1e-3)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.Adafactor, overlap_with_ddp=True, lr=0.01
    )
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    plain = torch.optim.Adafactor(ref.parameters(), lr=0.01)
    train_both([(ddp, zero), (ref, plain)], rank, world_size, 3, backward)
    out["Adafactor overlap"] = max_diff(model, ref_model)
    return out


def test_overlap_refuses_closures_and_runs_per_tensor_classes_whole() -> None:
    for out in run_ranks(_kinds_worker, 2, timeout_s=120):
        assert "LBFGS is registered as 'closure'" in out["LBFGS"]
        assert "overlap_with_ddp=False" in out["LBFGS"]
        # Bitwise by construction (two ranks, a sum of two either order; Adafactor runs whole
        # tensors, torch's own class on both sides); the bound is kept.
        assert out["Adafactor overlap"] < ATOL


# ---------------------------------------------------------------- GradScaler


OVERFLOW_AT = (1, 4)  # iterations where one rank's gradient gets an inf


def _scaler_worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("overlap", "overlap interleaved", "reduce hook"):
        for partition in ("sorted_greedy", "flat"):
            name = f"{mode} {partition}"
            model, ref_model = Net(), Net()
            ddp, ref = DDP(model, bucket_cap_mb=1e-3), DDP(ref_model, bucket_cap_mb=1e-3)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
            ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
            overlap = mode.startswith("overlap")
            zero = ZeroRedundancyOptimizer(
                ddp.parameters(),
                torch.optim.Adam,
                overlap_with_ddp=overlap,
                partition=partition,
                lr=0.01,
            )
            if overlap:
                wrap = (
                    hook_with_zero_step_interleaved
                    if "interleaved" in mode
                    else hook_with_zero_step
                )
                ddp.register_comm_hook(None, wrap(allreduce_hook, ddp, zero, grad_scaler=scaler))
            else:
                ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero, grad_scaler=scaler))
            plain = torch.optim.Adam(ref.parameters(), lr=0.01, **FUSED)
            scales: list[tuple[float, float]] = []
            for step in range(6):
                x, y = batch(rank, step)
                for d, o, s in ((ddp, zero, scaler), (ref, plain, ref_scaler)):
                    o.zero_grad()
                    loss = ((d(x) - y) ** 2).mean()
                    if step in OVERFLOW_AT and rank == world_size - 1:
                        # one element of one rank's gradient overflows
                        d.module.b.weight.register_hook(_poison_once())
                    s.scale(loss).backward()
                    if not (overlap and o is zero):
                        s.step(o)
                    s.update()
                scales.append((scaler.get_scale(), ref_scaler.get_scale()))
            zero.finish_param_sync()
            out[name] = max_diff(model, ref_model)
            out[f"{name} scales"] = scales
            if overlap:
                state = overlap_state(zero)
                assert state is not None
                out[f"{name} skipped"] = state.skipped
    return out


def _poison_once() -> Any:
    done = [False]

    def hook(grad: torch.Tensor) -> torch.Tensor | None:
        if done[0]:
            return None
        done[0] = True
        grad = grad.clone()
        grad[0, 0] = float("inf")
        return grad

    return hook


def test_grad_scaler_skips_overflowing_steps_exactly_as_ddp_with_a_scaler_does() -> None:
    for out in run_ranks(_scaler_worker, 3, timeout_s=300):
        for mode in ("overlap", "overlap interleaved", "reduce hook"):
            for partition in ("sorted_greedy", "flat"):
                name = f"{mode} {partition}"
                # At 3 ranks our reduce and DDP's all-reduce add the ranks' gradients in other
                # orders: an average differs by at most 2 u kappa of itself (u = 2^-24; kappa = sum
                # |g_r| / |sum g_r|, the seeded data's conditioning, not the machine's), which a
                # step (a ratio of gradient statistics, at most lr = 0.01 in size) carries over at
                # most twice: 6 steps x 2 x 0.01 x 2 u kappa = 1.4e-8 kappa, under ATOL while kappa
                # < 70. The scales are compared exactly (the same overflow verdicts).
                assert out[name] < ATOL, (name, out[name])
                ours, ref = zip(*out[f"{name} scales"])
                assert ours == ref, (name, out[f"{name} scales"])
                assert ref[1] < ref[0]  # the overflow did lower the scale
                if mode.startswith("overlap"):
                    assert out[f"{name} skipped"] == len(OVERFLOW_AT)
