"""Compressed collectives (issue 41): gradients' contributions cross in 8 or 16 bits and are summed
in fp32; parameters' changes cross likewise and every rank adds the same decoded change.

One spawn of 4 ranks runs every case (each spawn costs seconds); the bytes at 2 ranks in another.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from zero_functional import ZeroRedundancyOptimizer, checkpoint, comm, hooks
from zero_functional.comm import exchange
from zero_functional.core.plans import bytes_sent

from tests.helpers import local_backward, run_ranks

INT8, BF16, FP8 = torch.int8, torch.bfloat16, torch.float8_e4m3fn
MODES = ("step", "bucket view", "reduce_scatter_hook", "overlap", "interleaved")


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(7, 96), nn.Tanh(), nn.Linear(96, 40), nn.Tanh(), nn.Linear(40, 3)
    )
    return model.to(dtype)


def _build(
    mode: str, wire: torch.dtype | None, gather: torch.dtype | None, dtype: torch.dtype
) -> tuple[nn.Module, nn.Module, ZeroRedundancyOptimizer]:
    """The model, what backward runs through (a DDP with small buckets, or the model), ours."""
    model = _model(dtype=dtype)
    hooked = mode in ("reduce_scatter_hook", "overlap", "interleaved")
    ddp = DDP(model, bucket_cap_mb=0.004) if hooked else model
    overlap = mode in ("overlap", "interleaved")
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(),
        torch.optim.Adam,
        lr=1e-2,
        partition="flat",
        overlap_with_ddp=overlap,
        parameters_as_bucket_view=mode == "bucket view",
        gather_dtype=gather,
    )
    assert isinstance(ddp, DDP) or not hooked
    if mode == "reduce_scatter_hook":
        ddp.register_comm_hook(None, hooks.reduce_scatter_hook(ddp, zero, wire_dtype=wire))  # type: ignore[operator]
    elif overlap:
        make = (
            hooks.hook_with_zero_step
            if mode == "overlap"
            else hooks.hook_with_zero_step_interleaved
        )
        hook = make(default_hooks.allreduce_hook, ddp, zero, wire_dtype=wire)  # type: ignore[arg-type]
        ddp.register_comm_hook(None, hook)  # type: ignore[operator]
    return model, ddp, zero


def _iterate(
    ddp: nn.Module, zero: ZeroRedundancyOptimizer, rank: int, world: int, step: int
) -> None:
    zero.zero_grad()
    local_backward(ddp, rank, world, step)
    if not isinstance(ddp, DDP):  # no hook: average by hand, as DDP would
        for p in ddp.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= world
    if not zero.overlap_with_ddp:
        zero.step()
    zero.finish_param_sync()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def _same_everywhere(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return all(torch.equal(g, t) for g in gathered)


@contextmanager
def _counting(sent: list[float]) -> Iterator[None]:
    """Count the bytes this rank sends through the collectives our comm layer calls (looked up
    on torch.distributed when called): all-to-alls as their splits say, the rest as rings do."""
    originals = {n: getattr(dist, n) for n in ("all_to_all_single", "broadcast", "all_reduce")}

    def all_to_all(
        fn: Callable[..., Any], out: Any, inp: Any, out_splits: Any, in_splits: Any, **kw: Any
    ) -> Any:
        me = dist.get_rank(kw.get("group"))
        sent.append((sum(in_splits) - in_splits[me]) * inp.element_size())
        return fn(out, inp, out_splits, in_splits, **kw)

    def ring(op: str, fn: Callable[..., Any], t: Any, *args: Any, **kw: Any) -> Any:
        sent.append(
            bytes_sent(op, t.numel() * t.element_size(), dist.get_world_size(kw.get("group")))
        )
        return fn(t, *args, **kw)

    dist.all_to_all_single = functools.partial(all_to_all, originals["all_to_all_single"])  # type: ignore[assignment]
    dist.broadcast = functools.partial(ring, "broadcast", originals["broadcast"])  # type: ignore[assignment]
    dist.all_reduce = functools.partial(ring, "all_reduce", originals["all_reduce"])  # type: ignore[assignment]
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _bytes_per_step(rank: int, world: int) -> dict[str, float]:
    """Bytes this rank sends in a settled iteration, per mode and format (wire and gather)."""
    out: dict[str, float] = {}
    for mode in ("reduce_scatter_hook", "overlap", "interleaved"):
        for fmt in (None, BF16, INT8, FP8):
            _, ddp, zero = _build(mode, fmt, fmt, torch.float32)
            for step in range(3):  # DDP settles its buckets; overlap mode its ownership
                _iterate(ddp, zero, rank, world, step)
            sent: list[float] = []
            with _counting(sent):
                _iterate(ddp, zero, rank, world, 3)
            out[f"{mode}, {fmt}"] = sum(sent)
    return out


def _exchange_case(rank: int, world: int) -> dict[str, Any]:
    """The owner's sum vs the exact one, per element, against the sum of each contribution's
    rounding; a non-finite value in one rank's block makes the owner's block non-finite."""
    out: dict[str, Any] = {}
    numel = 3000
    runs = [(0, 700, 1), (700, 1900, 0), (1900, 2950, world - 1), (2950, 3000, 2)]
    values = [
        torch.randn(numel, generator=torch.Generator().manual_seed(100 + r)) * 10.0 ** (r - 1)
        for r in range(world)
    ]
    exact = sum(v.double() for v in values)
    exchanger = comm.Exchanger(dist.group.WORLD)
    for dtype in comm.WIRE_DTYPES:
        codec = comm.Codec(dtype)
        buffer = values[rank].clone()
        exchange.start_exchange(buffer, runs, dist.group.WORLD, exchanger, codec).wait()
        worst = 0.0
        for a, b, owner in runs:
            if owner == rank:
                # each other rank's contribution rounded once; fp32 sums of four terms add a
                # few ulps of the largest partial sum
                bound = sum(
                    codec.rounding_bound(values[r][a:b]).double() for r in range(world) if r != rank
                )
                slack = 8 * 2.0**-24 * sum(v[a:b].double().abs() for v in values)
                error = (buffer[a:b].double() - exact[a:b]).abs()
                worst = max(worst, float((error / (bound + slack)).max()))
        out[f"bound {dtype}"] = worst
        poisoned = values[rank].clone()
        if rank == 3:
            poisoned[710] = math.inf  # in rank 0's run: rank 3's block [700, 956) of it
        exchange.start_exchange(poisoned, runs, dist.group.WORLD, exchanger, codec).wait()
        if rank == 0:
            out[f"non-finite {dtype}"] = bool(poisoned[710].isfinite())
            block = poisoned[700:956]  # rank 3's contribution's block: NaN throughout
            out[f"block {dtype}"] = bool(block.isfinite().any()) if codec.blockwise else False
    return out


def _modes_case(rank: int, world: int) -> dict[str, Any]:
    """Every mode trains with each format: parameters bitwise equal on every rank, within half a
    quantum of the last change of the owner's main copy."""
    out: dict[str, Any] = {}
    for mode in MODES:
        for fmt in (INT8, FP8, BF16):  # (fp16 takes bf16's path: a cast)
            model, ddp, zero = _build(mode, fmt, fmt, torch.float32)
            for step in range(3):
                _iterate(ddp, zero, rank, world, step)
            before = {p: p.detach().clone() for p in model.parameters()}
            _iterate(ddp, zero, rank, world, 3)
            codec = comm.Codec(fmt)
            mains = {p: m.reshape(-1) for p, m in zero.main_params().items()}
            worst = 0.0
            pieces = {s.param: s for s in zero.ownership.owned(rank)}
            spans = {p: pieces[zero.param_table.index(p)] for p in mains}
            was = {p: before[p].reshape(-1)[spans[p].start : spans[p].stop] for p in mains}
            largest = max((float((m - was[p]).abs().max()) for p, m in mains.items()), default=0.0)
            for p, main in mains.items():
                now = p.detach().reshape(-1)[spans[p].start : spans[p].stop]
                change = main - was[p]
                if fmt == INT8:  # a block's scale is at most the largest change's over 127
                    bound = torch.full_like(main, largest / 127 / 2)
                elif fmt == FP8:  # 3 mantissa bits, and the subnormals' step of the scale
                    bound = torch.maximum(
                        change.abs() * 2.0**-4, torch.full_like(main, largest / 448 * 2.0**-10)
                    )
                else:
                    bound = codec.rounding_bound(change)
                slack = 2 * 2.0**-24 * now.abs()  # the add of the change, in fp32
                worst = max(worst, float(((now - main).abs() / (bound + slack + 1e-30)).max()))
            out[f"{mode}, {fmt}"] = (_same_everywhere(_flat(model)), len(mains) > 0, worst)
    return out


def _scaler_case(rank: int, world: int) -> dict[str, Any]:
    """An overflow on one rank survives int8 on the wire: every rank skips the step together."""
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.004)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.Adam, lr=1e-2, partition="flat", gather_dtype=INT8
    )
    hook = hooks.reduce_scatter_hook(ddp, zero, grad_scaler=scaler, wire_dtype=INT8)
    ddp.register_comm_hook(None, hook)
    before = _flat(model)
    x, y = torch.randn(3, 7), torch.randn(3, 3)
    if rank == 2:
        x[0, 0] = math.inf
    scaler.scale(((ddp(x) - y) ** 2).mean()).backward()
    scaler.step(zero)
    scaler.update()
    zero.finish_param_sync()
    return {"unchanged": torch.equal(_flat(model), before), "scale": scaler.get_scale()}


def _error_vs_fp16_hook(rank: int, world: int) -> dict[str, float]:
    """On the same gradients, wire_dtype=fp16's owned averages vs DDP's fp16_compress_hook's."""
    errors: dict[str, float] = {}
    grads: dict[str, list[torch.Tensor]] = {}
    for label in ("exact", "ours", "fp16_compress_hook"):
        model = _model(seed=3)
        ddp = DDP(model, bucket_cap_mb=0.004)
        zero = None
        if label == "ours":
            zero = ZeroRedundancyOptimizer(
                ddp.parameters(), torch.optim.SGD, lr=0.0, partition="flat"
            )
            ddp.register_comm_hook(
                None, hooks.reduce_scatter_hook(ddp, zero, wire_dtype=torch.float16)
            )
        elif label == "fp16_compress_hook":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        local_backward(ddp, rank, world, 7)
        gs = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
        if zero is not None:  # only the owned pieces hold the average: share them
            owned = [torch.zeros_like(g) for g in gs]
            for s in zero.ownership.owned(rank):
                owned[s.param].view(-1)[s.start : s.stop] = gs[s.param].view(-1)[s.start : s.stop]
            for t in owned:
                dist.all_reduce(t)
            gs = owned
        grads[label] = gs
    for label in ("ours", "fp16_compress_hook"):
        diff = torch.cat(
            [
                (a.double() - e.double()).abs().reshape(-1)
                for a, e in zip(grads[label], grads["exact"])
            ]
        )
        errors[f"{label} max"] = float(diff.max())
        errors[f"{label} mean"] = float(diff.mean())
    return errors


def _resume_case(rank: int, world: int, directory: str) -> dict[str, bool]:
    """With gather_dtype, a resume at the same world size is bitwise the uninterrupted run. (Not
    so with wire_dtype's blocks: they follow DDP's buckets, which a new DDP lays out anew.)"""
    runs = {}
    for resumed in (False, True):
        model, ddp, zero = _build("reduce_scatter_hook", None, INT8, torch.float32)
        for step in range(3):
            _iterate(ddp, zero, rank, world, step)
        if resumed:
            checkpoint.save(f"{directory}/ckpt", model=model, optimizer=zero)
            model, ddp, zero = _build("reduce_scatter_hook", None, INT8, torch.float32)
            checkpoint.load(f"{directory}/ckpt", model=model, optimizer=zero)
        for step in range(3, 6):
            _iterate(ddp, zero, rank, world, step)
        runs[resumed] = (_flat(model), [m.clone() for m in zero.main_params().values()])
    (params, mains), (params_resumed, mains_resumed) = runs[False], runs[True]
    return {
        "params": torch.equal(params, params_resumed),
        "mains": len(mains) > 0 and all(map(torch.equal, mains, mains_resumed)),
    }


def _composes_case(rank: int, world: int) -> dict[str, Any]:
    """int8 both ways with the rest: clipping and an EMA, Muon's whole matrices (the wire only:
    gather_dtype needs an elementwise class), torchao's low-bit state, a 2 x 2 mesh in overlap
    mode, sorted_greedy with split buckets: parameters bitwise equal on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    from zero_functional.ema import ShardedEMA

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out: dict[str, Any] = {}

    def zero_of(ddp: nn.Module, cls: Any = torch.optim.AdamW, **kw: Any) -> ZeroRedundancyOptimizer:
        return ZeroRedundancyOptimizer(ddp.parameters(), cls, lr=1e-2, **kw)

    def muon(ddp: nn.Module) -> ZeroRedundancyOptimizer:
        params = list(ddp.parameters())
        matrices = {
            "params": [p for p in params if p.ndim == 2],
            "optimizer_class": torch.optim.Muon,
        }
        groups = [{**matrices, "lr": 0.02}, {"params": [p for p in params if p.ndim != 2]}]
        return ZeroRedundancyOptimizer(groups, torch.optim.AdamW, lr=1e-2)

    cases: dict[str, tuple[Callable[[nn.Module], ZeroRedundancyOptimizer], str]] = {
        "clip and EMA": (lambda d: zero_of(d, partition="flat", gather_dtype=INT8), "rs"),
        "Muon": (muon, "rs"),
        "mesh, overlap": (
            lambda d: zero_of(
                d, partition="flat", device_mesh=mesh, gather_dtype=INT8, overlap_with_ddp=True
            ),
            "interleaved",
        ),
        "sorted_greedy, shard_buckets": (
            lambda d: zero_of(d, gather_dtype=INT8, overlap_with_ddp=True),
            "shard_buckets",
        ),
    }
    try:
        import torchao.optim

        torch.compiler.set_stance("force_eager")  # its compiled steps take seconds per shape

        cases["torchao AdamW8bit"] = (
            lambda d: zero_of(d, torchao.optim.AdamW8bit, partition="flat", gather_dtype=INT8),
            "rs",
        )
    except ImportError:  # the lowbit extra: make test installs it
        out["torchao AdamW8bit"] = "not installed"
    cases["bf16 model, fp32 main copies"] = (
        lambda d: zero_of(d, partition="flat", gather_dtype=INT8),
        "rs",
    )
    for name, (make, how) in cases.items():
        model = _model(dtype=torch.bfloat16 if name.startswith("bf16") else torch.float32)
        ddp = DDP(model, bucket_cap_mb=0.004)
        zero = make(ddp)
        if how == "rs":
            hook = hooks.reduce_scatter_hook(ddp, zero, wire_dtype=INT8)
        else:
            make_hook = (
                hooks.hook_with_zero_step_interleaved
                if how == "interleaved"
                else hooks.hook_with_zero_step
            )
            hook = make_hook(
                default_hooks.allreduce_hook, ddp, zero, how == "shard_buckets", wire_dtype=INT8
            )  # type: ignore[arg-type]
        ddp.register_comm_hook(None, hook)
        ema = ShardedEMA(zero, decay=0.9, model=model) if name == "clip and EMA" else None
        for step in range(3):
            zero.zero_grad()
            local_backward(ddp, rank, world, step)
            if ema is not None:
                zero.clip_grad_norm_(0.05)
            if not zero.overlap_with_ddp:
                zero.step()
        zero.finish_param_sync()
        equal = _same_everywhere(_flat(model))
        if ema is not None:
            with ema.swapped_into(model):
                equal = equal and _same_everywhere(_flat(model))
        out[name] = equal
    return out


def _worker(rank: int, world: int, directory: str) -> dict[str, Any]:
    return {
        "composes": _composes_case(rank, world),
        "exchange": _exchange_case(rank, world),
        "modes": _modes_case(rank, world),
        "scaler": _scaler_case(rank, world),
        "fp16": _error_vs_fp16_hook(rank, world),
        "resume": _resume_case(rank, world, directory),
        "bytes": _bytes_per_step(rank, world),
    }


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_worker, 4, str(tmp_path_factory.mktemp("compressed")), timeout_s=240)


def test_the_owner_sum_is_within_each_contributions_rounding(
    four_ranks: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(four_ranks):
        for dtype in comm.WIRE_DTYPES:
            assert result["exchange"][f"bound {dtype}"] <= 1.0, (rank, dtype)
    for dtype in comm.WIRE_DTYPES:
        assert four_ranks[0]["exchange"][f"non-finite {dtype}"] is False, dtype
        assert four_ranks[0]["exchange"][f"block {dtype}"] is False, dtype


def test_every_mode_keeps_parameters_equal_and_near_the_main_copies(
    four_ranks: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(four_ranks):
        for case, (same, has_mains, worst) in result["modes"].items():
            assert same, (rank, case)
            assert has_mains, (rank, case)  # every rank owns pieces of this model
            assert worst <= 1.0, (rank, case, worst)


def test_an_overflow_on_one_rank_skips_the_step_everywhere(
    four_ranks: list[dict[str, Any]],
) -> None:
    assert [r["scaler"]["unchanged"] for r in four_ranks] == [True] * 4
    assert [r["scaler"]["scale"] for r in four_ranks] == [2.0] * 4


def test_fp16_on_the_wire_is_no_less_exact_than_ddps_fp16_compress_hook(
    four_ranks: list[dict[str, Any]],
) -> None:
    errors = four_ranks[0]["fp16"]
    assert errors["ours max"] <= errors["fp16_compress_hook max"], errors
    assert errors["ours mean"] <= errors["fp16_compress_hook mean"], errors


def test_it_composes_with_the_rest(four_ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(four_ranks):
        assert set(result["composes"].values()) == {True}, (rank, result["composes"])


def test_a_resume_keeps_the_main_copies_and_is_bitwise_the_same(
    four_ranks: list[dict[str, Any]],
) -> None:
    assert [r["resume"] for r in four_ranks] == [{"params": True, "mains": True}] * 4


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_step_shrink_with_the_format(
    world: int, four_ranks: list[dict[str, Any]]
) -> None:
    results = four_ranks if world == 4 else run_ranks(_bytes_worker, 2, timeout_s=120)
    for mode in ("reduce_scatter_hook", "overlap", "interleaved"):
        full = sum(r["bytes"][f"{mode}, None"] for r in results)
        assert full > 0
        for fmt, most in ((INT8, 0.30), (FP8, 0.30), (BF16, 0.55)):
            ratio = sum(r["bytes"][f"{mode}, {fmt}"] for r in results) / full
            assert ratio <= most, (world, mode, fmt, ratio)


def _bytes_worker(rank: int, world: int) -> dict[str, Any]:
    return {"bytes": _bytes_per_step(rank, world)}
