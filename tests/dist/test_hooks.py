"""overlap_with_ddp on gloo: DDP + our hooks against DDP + a local torch.optim optimizer."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from zero_functional.app.launch import LaunchError
from zero_functional.hooks import (
    adopt_buckets,
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    overlap_state,
)
from zero_functional.optimizer import ZeroRedundancyOptimizer
from zero_functional.shell import overlap

from tests.helpers import FUSED, ours_kernel, run_ranks

ATOL = 1e-6


class Net(nn.Module):
    """Small MLP with an optional frozen sub-module and a layer used twice."""

    def __init__(self, twice: bool = False, frozen: bool = False, swap: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.mid = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16)
        self.out = nn.Linear(16, 2)
        self.twice = twice
        self.swap = swap  # use `frozen` before `mid`: DDP's rebuilt buckets differ from its first
        if frozen:
            self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        first, second = (self.frozen, self.mid) if self.swap else (self.mid, self.frozen)
        h = torch.tanh(first(h))
        if self.twice:
            h = torch.tanh(self.mid(h))
        h = torch.tanh(second(h))
        return self.out(h)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


CONFIGS: list[dict[str, Any]] = [
    {
        "opt": "adam",
        "interleaved": False,
        "shard": False,
        "gabv": False,
        "static": False,
        "cap": 25.0,
    },
    {
        "opt": "adam",
        "interleaved": True,
        "shard": False,
        "gabv": False,
        "static": False,
        "cap": 1e-4,
    },
    {"opt": "adam", "interleaved": True, "shard": True, "gabv": True, "static": False, "cap": 1e-4},
    {
        "opt": "adam",
        "interleaved": False,
        "shard": True,
        "gabv": False,
        "static": True,
        "cap": 1e-4,
    },
    {"opt": "sgd", "interleaved": False, "shard": False, "gabv": True, "static": True, "cap": 25.0},
    {
        "opt": "sgd",
        "interleaved": True,
        "shard": True,
        "gabv": False,
        "static": False,
        "cap": 1e-4,
        "twice": True,
    },
    {
        "opt": "adamw",
        "interleaved": True,
        "shard": False,
        "gabv": False,
        "static": True,
        "cap": 1e-4,
        "frozen": True,
    },
    {
        "opt": "sgd",
        "interleaved": False,
        "shard": True,
        "gabv": True,
        "static": False,
        "cap": 1e-4,
        "frozen": True,
    },
    # partition="flat": every rank owns 1/world_size of every bucket, even of a single one
    {
        "opt": "adam",
        "interleaved": False,
        "shard": False,
        "gabv": False,
        "static": False,
        "cap": 25.0,
        "partition": "flat",
    },
    {
        "opt": "adamw",
        "interleaved": True,
        "shard": False,
        "gabv": True,
        "static": False,
        "cap": 1e-4,
        "frozen": True,
        "partition": "flat",
    },
    {
        "opt": "sgd",
        "interleaved": True,
        "shard": False,
        "gabv": False,
        "static": True,
        "cap": 1e-4,
        "twice": True,
        "partition": "flat",
    },
]


OPTS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}


COLLECTIVES = ("reduce+broadcast", "allreduce+broadcast")


def _overlap_worker(rank: int, world_size: int, iterations: int) -> list[tuple[str, float, float]]:
    out: list[tuple[str, float, float]] = []
    moved_bucket0 = False
    for cfg in [{**c, "coll": coll} for c in CONFIGS for coll in COLLECTIVES]:
        cls, kw = OPTS[cfg["opt"]]
        torch.manual_seed(0)
        model = Net(cfg.get("twice", False), cfg.get("frozen", False))
        torch.manual_seed(0)
        ref_model = Net(cfg.get("twice", False), cfg.get("frozen", False))
        initial = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        ddp_kw = {
            "bucket_cap_mb": cfg["cap"],
            "gradient_as_bucket_view": cfg["gabv"],
            "static_graph": cfg["static"],
        }
        ddp = DDP(model, **ddp_kw)
        ref = DDP(ref_model, **ddp_kw)
        zero = ZeroRedundancyOptimizer(
            [p for p in ddp.parameters() if p.requires_grad],
            cls,
            overlap_with_ddp=True,
            partition=cfg.get("partition", "sorted_greedy"),
            **kw,
        )
        wrap = hook_with_zero_step_interleaved if cfg["interleaved"] else hook_with_zero_step
        ddp.register_comm_hook(
            None,
            wrap(allreduce_hook, ddp, zero, shard_buckets=cfg["shard"], collectives=cfg["coll"]),
        )
        ref_opt = cls([p for p in ref.parameters() if p.requires_grad], **kw, **ours_kernel(cls))
        # unlike torch's, state dicts work before the first backward (they are empty)
        zero.consolidate_state_dict(to=0)
        if rank == 0:
            assert zero.state_dict()["state"] == {}
        worst = 0.0
        faked: int | None = None
        faked_once = False
        fake_owners: list[Any] = []
        for step in range(iterations):
            x, y = _batch(rank, step)
            zero.zero_grad()
            ((ddp(x) - y) ** 2).mean().backward()  # the step runs inside backward
            ref_opt.zero_grad()
            ((ref(x) - y) ** 2).mean().backward()
            ref_opt.step()
            zero.finish_param_sync()  # the all-gather would otherwise finish in the next forward
            worst = max(
                worst,
                max(
                    (a - b).abs().max().item()
                    for a, b in zip(model.parameters(), ref_model.parameters())
                ),
            )
            overlap = overlap_state(zero)
            assert overlap is not None
            s = overlap.structure
            assert s is not None
            if faked is not None:
                assert overlap.restructures == faked + 1, (faked, overlap.restructures)
                now = [zero.ownership.holders(k) for k in s[0]]
                moved_bucket0 = moved_bucket0 or fake_owners != now
                faked = None
            elif not faked_once and len(s) > 2 and step + 1 < iterations:
                # A structure change after the first bucket (as a DDP rebuild can make): the next
                # backward reduces bucket 0 under this assignment, then finds bucket 1 changed.
                # The smallest parameter alone in bucket 1 makes shard_buckets' smallest-first
                # rule give bucket 0 to another rank than the real structure does.
                rest = [k for b in s[1:] for k in b]
                small = min(rest, key=lambda k: zero.param_table.params[k].numel())
                adopt_buckets(zero, (s[0], (small,), tuple(k for k in rest if k != small)))
                fake_owners = [zero.ownership.holders(k) for k in s[0]]
                faked, faked_once = overlap.restructures, True
            if cfg.get("partition") == "flat" and world_size > 1:
                # every rank owns a piece of every bucket: state is sharded even in one bucket
                assert all(zero.ownership.loads), zero.ownership.loads
        overlap = overlap_state(zero)
        assert overlap is not None
        expect_reduce = cfg["coll"] == "reduce+broadcast" and world_size > 1
        assert (overlap.reduced_buckets > 0) == expect_reduce, (cfg, overlap.reduced_buckets)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(world_size)]
        dist.all_gather(gathered, flat)
        spread = max((g - flat).abs().max().item() for g in gathered)
        moved = (flat - initial).abs().max().item()
        assert moved > 0  # the step inside backward changed the parameters
        zero.consolidate_state_dict(to=0)
        if rank == 0:
            sd = zero.state_dict()
            n = len([p for p in model.parameters() if p.requires_grad])
            assert len(sd["state"]) == n, (len(sd["state"]), n)
        out.append((str(cfg), worst, spread))
    # LR schedulers work in overlap mode: lr 0 freezes the parameters (torch's keeps moving them)
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=0.01
    )
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    x, y = _batch(rank, 0)
    ((ddp(x) - y) ** 2).mean().backward()
    zero.param_groups[0]["lr"] = 0.0
    zero.finish_param_sync()
    before = [p.detach().clone() for p in model.parameters()]
    ((ddp(x) - y) ** 2).mean().backward()
    zero.finish_param_sync()
    out.append(
        ("lr=0", max((a - b).abs().max().item() for a, b in zip(model.parameters(), before)), 0.0)
    )
    assert zero.step() is None
    # the mid-backward structure change did move bucket 0 to another rank in some configuration
    out.append(("bucket 0 moved", 0.0 if moved_bucket0 or world_size == 1 else 1.0, 0.0))
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_overlap_matches_ddp_with_a_local_optimizer_from_the_first_iteration(
    world_size: int,
) -> None:
    for rank_result in run_ranks(_overlap_worker, world_size, 4, timeout_s=300):
        for name, worst, spread in rank_result:
            # Both sides average the same gradients (at 2 ranks: a sum of two, either order) and run
            # the same kernels (a reference Adam is FUSED, the kernel ours runs; SGD and the rest
            # run torch's own on both), so they differ only where a piece cut off a tensor puts
            # elements in a kernel's scalar tail rather than its vector body: a few ulps of an
            # update per step, which move a parameter by one ulp of itself only where they cross a
            # rounding boundary: at most 4 steps x ulp(|p| < 1) = 2.4e-7 < 1e-6 (|p| < 1, ulp <=
            # 6e-8: these layers start below 0.5 and move little). At 3 and 4 ranks our reduce and
            # DDP's all-reduce add the ranks' gradients in other orders: an average differs by at
            # most 3 u kappa of itself (u = 2^-24; kappa = sum |g_r| / |sum g_r|, the seeded data's
            # conditioning, not the machine's), which a step (a ratio of gradient statistics, at
            # most lr = 0.05 in size) carries over at most twice: 4 steps x 2 x 0.05 x 3 u kappa =
            # 7.2e-8 kappa, under ATOL while kappa < 13.
            assert worst < ATOL, (name, worst)
            assert spread == 0.0, (name, spread)


def _kill_worker(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=1e-4)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=0.01
    )
    hook = hook_with_zero_step_interleaved(allreduce_hook, ddp, zero)

    def dying_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if rank == 1 and bucket.index() == 1 and getattr(dying_hook, "armed", False):
            os._exit(3)
        return hook(state, bucket)

    dying_hook.__annotations__ = {
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    ddp.register_comm_hook(None, dying_hook)
    for step in range(3):
        dying_hook.armed = step == 2  # type: ignore[attr-defined]
        x, y = _batch(rank, step)
        ((ddp(x) - y) ** 2).mean().backward()
    return "survived"


def test_a_rank_killed_mid_backward_makes_the_others_fail_not_hang() -> None:
    with pytest.raises(LaunchError) as info:
        run_ranks(_kill_worker, 2, timeout_s=90, pg_timeout_s=15)
    assert info.value.headline == "rank 1 exited with code 3", str(info.value)


def _errors_worker(rank: int, world_size: int) -> bool:
    model = Net()
    with pytest.raises(ValueError, match="LBFGS is registered as 'closure'"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.LBFGS, overlap_with_ddp=True)
    ddp = DDP(model)
    plain = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01)
    with pytest.raises(ValueError, match="overlap_with_ddp=True"):
        hook_with_zero_step(allreduce_hook, ddp, plain)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=0.01
    )
    with pytest.raises(RuntimeError, match="single parameter group"):
        zero.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    logging.disable(logging.WARNING)
    assert zero.step() is None
    return True


def test_overlap_rejects_what_it_cannot_do() -> None:
    assert all(run_ranks(_errors_worker, 1, timeout_s=60))


def _policy_worker(rank: int, world_size: int) -> list[str]:
    """What the hooks pick by default, and that reduce+broadcast refuses a custom hook."""
    picked = []
    for hook in (allreduce_hook, _custom_hook):
        ddp = DDP(Net())
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=0.01
        )
        hook_with_zero_step(hook, ddp, zero)
        overlap = overlap_state(zero)
        assert overlap is not None
        picked.append(overlap.collectives)
    ddp = DDP(Net())
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=0.01
    )
    with pytest.raises(ValueError, match="custom hook"):
        hook_with_zero_step(_custom_hook, ddp, zero, collectives="reduce+broadcast")
    with pytest.raises(ValueError, match="collectives must be one of"):
        hook_with_zero_step(allreduce_hook, ddp, zero, collectives="all_to_all")  # type: ignore[arg-type]
    return picked


def _custom_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return allreduce_hook(state, bucket)


def test_hooks_default_to_reduce_broadcast_for_allreduce_hook_only() -> None:
    for picked in run_ranks(_policy_worker, 2, timeout_s=60):
        assert picked == ["reduce+broadcast", "allreduce+broadcast"]


class _WaitFor(torch.autograd.Function):
    """The identity, whose backward waits (up to ``timeout`` s) until a tensor of ``watched``
    has changed on this rank, and records in ``seen`` whether one did: whether this rank's
    pieces of the buckets after it in backward were updated while backward was still going on
    (the rest arrives with the all-gather, written when it is waited for)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, watched: list[torch.Tensor], seen: list[bool], timeout: float
    ) -> torch.Tensor:
        ctx.watched, ctx.seen, ctx.timeout = watched, seen, timeout
        ctx.before = [w.detach().clone() for w in watched]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        deadline = time.monotonic() + ctx.timeout
        changed = False
        while not changed and time.monotonic() < deadline:
            changed = any(not torch.equal(w, b) for w, b in zip(ctx.watched, ctx.before))
            time.sleep(0.001)
        ctx.seen.append(changed)
        return grad, None, None, None


class _Waiting(nn.Module):
    """``first`` -> tanh -> (wait until ``last`` has changed, in backward) -> ``last``."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(6, 16), nn.Linear(16, 2)
        self.seen: list[bool] = []
        self.timeout = 0.0  # not armed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        if self.timeout:
            h = _WaitFor.apply(h, list(self.last.parameters()), self.seen, self.timeout)
        return self.last(h)


def _update_thread_worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for threaded in (True, False):
        torch.manual_seed(0)
        model, ref_model = _Waiting(), _Waiting()
        ref_model.load_state_dict(model.state_dict())
        ddp, ref = DDP(model, bucket_cap_mb=1e-4), DDP(ref_model, bucket_cap_mb=1e-4)
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(), torch.optim.Adam, overlap_with_ddp=True, partition="flat", lr=0.01
        )
        ddp.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, ddp, zero))
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01, **FUSED)
        original = overlap.threaded
        overlap.threaded = (lambda buffer: False) if not threaded else original
        try:
            for step in range(5):
                # armed once DDP's buckets are rebuilt and adopted (the third backward on)
                model.timeout = 2.0 if step >= 3 else 0.0
                x, y = _batch(rank, step)
                zero.zero_grad()
                ((ddp(x) - y) ** 2).mean().backward()
                ref_opt.zero_grad()
                ((ref(x) - y) ** 2).mean().backward()
                ref_opt.step()
                zero.finish_param_sync()
        finally:
            overlap.threaded = original
        out[f"seen {threaded}"] = model.seen
        out[f"diff {threaded}"] = max(
            (a - b).abs().max().item() for a, b in zip(model.parameters(), ref_model.parameters())
        )
    # an error in the update thread is raised by backward, on the autograd thread
    torch.manual_seed(0)
    ddp = DDP(_Waiting(), bucket_cap_mb=1e-4)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.Adam, overlap_with_ddp=True, partition="flat", lr=0.01
    )
    ddp.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, ddp, zero))
    armed = [False]

    def failing(values: Any) -> None:
        if armed[0]:
            raise ValueError("an update hook failed")

    zero.register_update_hook(failing)
    for step in range(3):
        x, y = _batch(rank, step)
        ((ddp(x) - y) ** 2).mean().backward()
        zero.finish_param_sync()
    armed[0] = True
    x, y = _batch(rank, 3)
    try:
        ((ddp(x) - y) ** 2).mean().backward()
        out["error"] = ""
    except Exception as e:
        out["error"] = str(e)
    return out


def test_interleaved_updates_each_bucket_during_backward_on_a_thread() -> None:
    # On the CPU a bucket is updated and gathered as soon as its reduction is done, while
    # backward goes on (issue 33: DDP's first bucket, then one large one, left it for the end).
    # Without the thread (the autograd thread at a later bucket's hook) the layer before the
    # last one waits in vain; the training is the same either way.
    for out in run_ranks(_update_thread_worker, 2, timeout_s=120):
        assert out["seen True"] == [True, True], out
        assert out["seen False"] == [False, False], out
        # Both sides average the same gradients (two ranks: a sum of two, either order) and run the
        # same kernels (a reference Adam is FUSED, the kernel ours runs; SGD and the rest run
        # torch's own on both), so they differ only where a piece cut off a tensor puts elements in
        # a kernel's scalar tail rather than its vector body: a few ulps of an update per step,
        # which move a parameter by one ulp of itself only where they cross a rounding boundary: at
        # most 5 steps x ulp(|p| < 1) = 3e-7 < 1e-6 (|p| < 1, ulp <= 6e-8: these layers start below
        # 0.5 and move little).
        assert out["diff True"] < ATOL and out["diff False"] < ATOL, out
        assert "an update hook failed" in out["error"], out


def _first_buckets_let_go(rank: int, world_size: int) -> list[list[bool]]:
    """Per iteration, whether each bucket buffer DDP handed our reduction has been freed; after
    backward with ``reduce_scatter_hook``, at the default partition and at ``"flat"``."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    from zero_functional.hooks import reduce_scatter_hook
    from zero_functional.shell.bucket_sync import BucketSync

    seen: list[list[StorageWeakRef]] = []
    start_grad = BucketSync.start_grad

    def recording(self: BucketSync, bucket: torch.Tensor) -> None:
        seen[-1].append(StorageWeakRef(bucket.untyped_storage()))
        start_grad(self, bucket)

    BucketSync.start_grad = recording  # type: ignore[method-assign]
    out = []
    try:
        for partition in ("sorted_greedy", "flat"):
            torch.manual_seed(0)
            model = Net(swap=True)
            ddp = DDP(model, bucket_cap_mb=1e-3)  # one bucket, then three after the rebuild
            zero = ZeroRedundancyOptimizer(
                model.parameters(), torch.optim.Adam, lr=0.01, partition=partition
            )
            ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
            seen.clear()
            for step in range(3):
                seen.append([])
                x, y = _batch(rank, step)
                ((ddp(x) - y) ** 2).mean().backward()
                zero.step()
                zero.zero_grad()
            gc.collect()
            out += [[ref.expired() for ref in refs] for refs in seen]
    finally:
        BucketSync.start_grad = start_grad  # type: ignore[method-assign]
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddps_first_bucket_buffers_are_freed_once_it_rebuilds_its_buckets(world_size: int) -> None:
    """Issue 42, item 9: after DDP's rebuild (its second iteration) the buffers of its first
    buckets outlived it, held by our reductions: a model's gradients more at every step after
    backward (an 8M MLP: +30 MiB a rank). Each is let go once reduced: the first iteration's are
    freed, the last's are DDP's own, alive."""
    for result in run_ranks(_first_buckets_let_go, world_size):
        for first, *_, last in (result[:3], result[3:]):
            assert first and all(first), result
            assert last and not any(last), result
