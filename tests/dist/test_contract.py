"""torch's observable contract at the defaults, and the opt-in that changes it made safe.

Issue #19 parts 1-3 and issue #20's overlap-mode cases:

* parameters are final when backward (overlap mode) and ``step()`` return, by default;
* with ``overlap_param_gather=True`` nothing reads a stale value silently: module forwards
  for every parameter under them, ``module.state_dict()`` finishes first, and a parameter
  read in flight outside any forward is an error naming it;
* ``load_state_dict`` is local; ``state_dict()`` answers every caller without a collective;
* overlap mode skips parameters no rank used (``find_unused_parameters``), refuses ``Join`` and
  ``scaler.step(zero)``; unfreezing a parameter is an error in every mode.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from zero_functional.hooks import (
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    reduce_scatter_hook,
)
from zero_functional.optimizer import PARTIAL_KEY, ZeroRedundancyOptimizer

from tests.helpers import FUSED, max_diff, run_ranks

HOOKS = {"hook": hook_with_zero_step, "interleaved": hook_with_zero_step_interleaved}


class Net(nn.Module):
    """An embedding tied to the output head, a ParameterList read by the parent's forward, a
    branch that skips a layer on odd steps, and a layer whose forward never runs (``side``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.mid = nn.Linear(8, 8)
        self.skip = nn.Linear(8, 8)
        self.gains = nn.ParameterList([nn.Parameter(torch.ones(8)), nn.Parameter(torch.ones(8))])
        self.side = nn.Linear(300, 300)  # large enough to travel alone (not packed)
        self.read_side = False  # read side.weight directly, outside any module forward
        self.use_skip = True

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx) * self.gains[0]
        h = torch.tanh(self.mid(h)) * self.gains[1]
        if self.use_skip:
            h = torch.tanh(self.skip(h))
        if self.read_side:
            h = h + self.side.weight.mean()
        return F.linear(h, self.emb.weight)  # the tied head


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 11, (6,), generator=g), torch.randint(0, 11, (6,), generator=g)


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    idx, target = _batch(rank, step)
    return F.cross_entropy(model(idx), target)


def _pair(
    mode: str, partition: str, *, gather: bool | None = None, find_unused: bool = False
) -> tuple[nn.Module, DDP, Any, nn.Module, DDP, torch.optim.Optimizer]:
    """Our model under DDP + ZeRO in ``mode``, and the reference: DDP + a local Adam."""
    model, ref_model = Net(), Net()
    kwargs: dict[str, Any] = {"bucket_cap_mb": 0.0005, "find_unused_parameters": find_unused}
    ddp, ref = DDP(model, **kwargs), DDP(ref_model, **kwargs)
    extra = {} if gather is None else {"overlap_param_gather": gather}
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(),
        torch.optim.Adam,
        overlap_with_ddp=mode in HOOKS,
        partition=partition,
        lr=0.01,
        **extra,
    )
    if mode in HOOKS:
        ddp.register_comm_hook(None, HOOKS[mode](allreduce_hook, ddp, zero))
    elif mode == "reduce_scatter":
        ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
    return model, ddp, zero, ref_model, ref, torch.optim.Adam(ref.parameters(), lr=0.01, **FUSED)


def _contract_worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # 1. the defaults: final parameters when backward (overlap) / step() returns; a parameter
    # that sits out some iterations (find_unused_parameters) is skipped as torch's Adam skips it
    for mode in ("hook", "interleaved", "step", "reduce_scatter"):
        for partition in ("sorted_greedy", "flat"):
            model, ddp, zero, ref_model, ref, plain = _pair(mode, partition, find_unused=True)
            assert zero.overlap_param_gather is False
            worst = 0.0
            for step in range(6):
                for m in (model, ref_model):
                    m.use_skip = step % 2 == 0
                for d, o in ((ddp, zero), (ref, plain)):
                    o.zero_grad()
                    _loss(d, rank, step).backward()
                    if o is plain or mode not in HOOKS:
                        o.step()
                # read right away, as torch's tests and a user's model.state_dict() do
                worst = max(worst, max_diff(model, ref_model))
            out[f"final {mode} {partition}"] = worst

    # 2. overlap_param_gather=True: module forwards (ParameterList included) and state_dict wait
    for mode in ("interleaved", "reduce_scatter"):
        model, ddp, zero, ref_model, ref, plain = _pair(
            mode, "sorted_greedy", gather=True, find_unused=True
        )
        worst_sd = 0.0
        for step in range(4):
            for d, o in ((ddp, zero), (ref, plain)):
                o.zero_grad()
                _loss(d, rank, step).backward()
                if o is plain or mode not in HOOKS:
                    o.step()
            sd = model.state_dict()  # finishes the all-gather first
            worst_sd = max(
                worst_sd,
                max((sd[k] - v).abs().max().item() for k, v in ref_model.state_dict().items()),
            )
        out[f"gather {mode} state_dict"] = worst_sd
        zero.finish_param_sync()
        out[f"gather {mode} params"] = max_diff(model, ref_model)
        # read by the parent's forward (waits); read outside any forward in flight: named
        model.read_side = True
        zero.zero_grad()
        _loss(ddp, rank, 9).backward()
        if mode not in HOOKS:
            zero.step()  # leaves the all-gather in flight
        zero.zero_grad()
        try:
            model.side.weight.mean().backward()
            out[f"gather {mode} stale read"] = "no error"
        except RuntimeError as e:
            out[f"gather {mode} stale read"] = str(e)
        dist.barrier()
    return out


def test_parameters_are_final_at_the_defaults_and_never_stale_when_gathered_in_forward() -> None:
    for result in run_ranks(_contract_worker, 2, timeout_s=240):
        for name, value in result.items():
            if "stale read" in name:
                assert "'module.side.weight'" in value and "finish_param_sync()" in value, value
            else:
                # Both sides average the same gradients (two ranks: a sum of two, either order), so
                # only the update kernels differ: a few ulps of an update (<= lr = 0.01) per step,
                # which move a parameter one ulp of itself (the embedding's N(0, 1) values: <=
                # 2.4e-7 below 4) only where they cross a rounding boundary (odds <= 0.01 x 2 / |p|
                # per element and step): the bound needs 5 crossings of one element in one direction
                # within 6 steps.
                assert value < 1e-6, (name, value)


def _state_dict_worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    # before any step: torch's format, no collective (rank 0 alone asks)
    if rank == 0:
        sd = zero.state_dict()
        out["fresh"] = (sd["state"], len(sd["param_groups"][0]["params"]), PARTIAL_KEY in sd)
        zero.load_state_dict(sd)  # what Accelerate's prepare() does: still "before any step"
        out["fresh after load"] = zero.state_dict()["state"]
    dist.barrier()

    def step(k: int) -> None:
        zero.zero_grad()
        g = torch.Generator().manual_seed(k)
        model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
        zero.step()

    step(0)
    try:
        zero.state_dict()
    except RuntimeError as e:
        out["stale"] = str(e)
    zero.consolidate_state_dict(to=1)
    sd = zero.state_dict()
    out["consolidated"] = (len(sd["state"]), sd.get(PARTIAL_KEY, False))
    full = copy.deepcopy(sd) if rank == 1 else None
    try:
        zero.load_state_dict(sd)
        out["load partial"] = "loaded"
    except ValueError as e:
        out["load partial"] = str(e)

    # load_state_dict is local: a bad dict on rank 0 alone fails there, and the ranks' next
    # collectives still pair up
    objs = [full]
    dist.broadcast_object_list(objs, src=1)
    good = objs[0]
    assert good is not None
    bad = copy.deepcopy(good)
    bad["state"][0]["exp_avg"] = torch.zeros(7)
    try:
        zero.load_state_dict(bad if rank == 0 else good)
        out["one rank's bad dict"] = "loaded"
    except ValueError as e:
        out["one rank's bad dict"] = str(e)
    other = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    if rank == 0:
        other.load_state_dict(good)  # on one rank only: no collective to pair
    step(1)
    zero.consolidate_state_dict(to=0)
    out["after"] = len(zero.state_dict()["state"]) if rank == 0 else None
    return out


def test_state_dict_answers_every_caller_and_load_is_local() -> None:
    r0, r1 = run_ranks(_state_dict_worker, 2, timeout_s=120)
    assert r0["fresh"] == ({}, 4, False) and r0["fresh after load"] == {}
    for r in (r0, r1):
        assert r["stale"].startswith("Optimizer state has not been consolidated"), r["stale"]
        assert "consolidate_state_dict(to=" in r["stale"]
    assert r1["consolidated"] == (4, False) and r1["load partial"] == "loaded"
    assert r0["consolidated"] == (0, True) and "partial" in r0["load partial"]
    assert "exp_avg" in r0["one rank's bad dict"] and r1["one rank's bad dict"] == "loaded"
    assert r0["after"] == 4


def _refusals_worker(rank: int, world_size: int) -> dict[str, str]:
    out: dict[str, str] = {}
    # Join in overlap mode: refused on every rank before anything runs
    model, ddp, zero, *_ = _pair("hook", "flat")
    try:
        with Join([ddp, zero]):
            pass
        out["join"] = "entered"
    except RuntimeError as e:
        out["join"] = str(e)
    # the usual AMP recipe in overlap mode: scaler.step(zero) names grad_scaler=
    scaler = torch.amp.GradScaler("cpu")
    zero.zero_grad()
    scaler.scale(_loss(ddp, rank, 0)).backward()
    try:
        scaler.step(zero)
        out["scaler.step"] = "stepped"
    except RuntimeError as e:
        out["scaler.step"] = str(e)
    # unfreezing a parameter that was frozen when DDP and the optimizer were built
    for mode in ("step", "hook"):
        model = Net()
        model.skip.requires_grad_(False)
        ddp = DDP(model, find_unused_parameters=True)  # `side` is not used
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(),  # the frozen layer too, as model.parameters() gives it
            torch.optim.Adam,
            overlap_with_ddp=mode == "hook",
            lr=0.01,
        )
        if mode == "hook":
            ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
        _loss(ddp, rank, 0).backward()
        if mode == "step":
            zero.step()
        model.skip.requires_grad_(True)
        before = [p.detach().clone() for p in model.parameters()]
        try:
            zero.zero_grad()
            _loss(ddp, rank, 1).backward()
            if mode == "step":
                zero.step()
            out[f"unfreeze {mode}"] = "stepped"
        except RuntimeError as e:
            out[f"unfreeze {mode}"] = str(e)
        if mode == "step":
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        dist.barrier()
    return out


def test_overlap_mode_refuses_join_and_scaler_step_and_unfreezing_is_named() -> None:
    for result in run_ranks(_refusals_worker, 2, timeout_s=120):
        assert "Join does not work with overlap_with_ddp=True" in result["join"], result
        assert "grad_scaler=scaler" in result["scaler.step"], result
        for mode in ("step", "hook"):
            message = result[f"unfreeze {mode}"]
            assert "were frozen" in message and "(8, 8)" in message, message
