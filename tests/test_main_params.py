"""fp32 main parameters for bf16 models (issue 22): parity with a single-process fp32-main
reference given the same reduced gradients, in every mode, at 1-4 ranks; state dicts."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from zero_functional.hooks import (
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    reduce_scatter_hook,
)
from zero_functional.launch import run_ranks
from zero_functional.main_params import MAIN_KEY
from zero_functional.optimizer import ZeroRedundancyOptimizer

from tests.helpers import consolidated, local_batch, make_model

BF16 = torch.bfloat16
STEPS = 30
FP32 = torch.float32
MODES: list[tuple[str, str, torch.dtype | None]] = [  # (the step, partition, reduce_dtype)
    ("after", "sorted_greedy", None),
    ("after", "flat", None),
    ("reduce_scatter_hook", "flat", None),
    ("reduce_scatter_hook", "flat", FP32),
    ("hook_with_zero_step", "flat", None),
    ("hook_with_zero_step_interleaved", "flat", None),
    ("hook_with_zero_step_interleaved", "flat", FP32),
    ("hook_with_zero_step_interleaved", "sorted_greedy", FP32),
]


def _train(
    rank: int, world_size: int, mode: str, partition: str, reduce_dtype: torch.dtype | None
) -> dict[str, Any]:
    """Train a bf16 model with fp32 main pieces; step a single fp32 reference on the same
    reduced gradients (every rank's owned pieces, gathered); compare."""
    model = make_model(dtype=BF16)
    ddp = DDP(model)
    overlap = mode.startswith("hook_with")
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(),
        torch.optim.AdamW,
        lr=1e-3,
        weight_decay=0.01,
        partition=partition,
        overlap_with_ddp=overlap,
        main_params_dtype=torch.float32,
    )
    if mode == "reduce_scatter_hook":
        ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero, reduce_dtype=reduce_dtype))
    elif overlap:
        wrap = (
            hook_with_zero_step
            if mode == "hook_with_zero_step"
            else hook_with_zero_step_interleaved
        )
        ddp.register_comm_hook(None, wrap(allreduce_hook, ddp, zero, reduce_dtype=reduce_dtype))
    params = list(model.parameters())
    ref = [p.detach().float().clone() for p in params]
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01, foreach=False)
    seen: list[tuple[int, int, int, torch.Tensor]] = []
    grad_dtypes: set[torch.dtype] = set()
    update_owned = zero.update_owned

    def recording(grads: Any) -> None:  # the reduced gradients this rank's update is given
        pieces = {s.param: s for s in zero.ownership.owned(zero.rank)}
        for k, g in grads.items():
            grad_dtypes.add(g.dtype)
            seen.append((k, pieces[k].start, pieces[k].stop, g.detach().float().reshape(-1)))
        update_owned(grads)

    zero.update_owned = recording  # type: ignore[method-assign]
    for step in range(STEPS):
        x, y = local_batch(rank, world_size, step, BF16)
        ((ddp(x) - y).float() ** 2).mean().backward()
        if not overlap:
            zero.step()
        everyone: list[Any] = [None] * world_size
        dist.all_gather_object(everyone, seen)
        seen.clear()
        for r in ref:
            r.grad = torch.zeros_like(r)
        covered = [torch.zeros(r.numel(), dtype=torch.int32) for r in ref]
        for pieces in everyone:
            for k, a, b, g in pieces:
                ref[k].grad.view(-1)[a:b] = g  # type: ignore[union-attr]
                covered[k][a:b] += 1
        assert all(bool((c == 1).all()) for c in covered), "a gradient element not updated once"
        ref_opt.step()
        ddp.zero_grad(set_to_none=True)
    mains = zero.main_params()
    rel = 0.0
    for s in zero.ownership.owned(zero.rank):
        want = ref[s.param].reshape(-1)[s.start : s.stop]
        got = mains[params[s.param]].reshape(-1)
        rel = max(rel, (got - want).abs().max().item() / want.abs().max().item())
        piece = params[s.param].detach().reshape(-1)[s.start : s.stop]
        assert torch.equal(piece, got.to(BF16)), "a parameter piece is not its main copy rounded"
    flat = torch.cat([p.detach().float().reshape(-1) for p in params])
    every: list[torch.Tensor] = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(every, flat)
    dtypes = {
        str(v.dtype)
        for s in zero.ownership.owned(zero.rank)
        for v in zero.state[params[s.param]].values()
        if isinstance(v, torch.Tensor)
    }
    return {
        "rel": rel,
        "same": all(torch.equal(every[0], f) for f in every),
        "owned": len(zero.ownership.owned(zero.rank)),
        "grad_dtypes": sorted(str(d) for d in grad_dtypes),
        "dtypes": sorted(dtypes),
    }


def _parity_worker(rank: int, world_size: int) -> list[tuple[Any, ...]]:
    return [(*m, _train(rank, world_size, *m)) for m in MODES]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fp32_main_pieces_match_a_single_process_fp32_reference(world_size: int) -> None:
    for results in run_ranks(_parity_worker, world_size, timeout_s=400):
        for mode, part, reduce_dtype, r in results:
            case = (mode, part, reduce_dtype, r)
            assert r["rel"] <= 1e-6, case
            assert r["same"], (case, "ranks hold different parameters")
            assert r["dtypes"] == (["torch.float32"] if r["owned"] else []), case
            # reduced in fp32, overlap mode updates from the fp32 values, never rounded, once
            # the buckets are known (the first backward all-reduces in fp32, rounded once)
            wide = reduce_dtype is not None and mode.startswith("hook_with") and world_size > 1
            if r["owned"]:
                assert ("torch.float32" in r["grad_dtypes"]) == wide, case


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(BF16)


def _changed(main_params_dtype: torch.dtype | None) -> float:
    """The stagnation probe of the issue: share of weights a bf16 MLP's 10 AdamW steps at
    lr=1e-4 change."""
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, lr=1e-4, main_params_dtype=main_params_dtype
    )
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).to(BF16)
    for _ in range(10):
        model.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()
    moved = sum(int((p != b).sum()) for p, b in zip(model.parameters(), before))
    return moved / sum(b.numel() for b in before)


def _learns_worker(rank: int, world_size: int) -> tuple[float, float]:
    return _changed(None), _changed(torch.float32)


def test_bf16_weights_keep_learning_with_fp32_main_pieces() -> None:
    (plain, main), *_ = run_ranks(_learns_worker, 1, timeout_s=120)
    assert main >= 0.8, main
    assert plain < 0.5, plain  # bf16 state and weights: most small updates vanish


def _state_worker(rank: int, world_size: int) -> dict[str, Any]:
    model = make_model(dtype=BF16)
    zero = ZeroRedundancyOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        lr=1e-3,
        partition="flat",
        main_params_dtype=torch.float32,
    )
    for step in range(3):
        x, y = local_batch(rank, world_size, step, BF16)
        ((model(x) - y).float() ** 2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # type: ignore[arg-type]
        zero.step()
        model.zero_grad()
    out: dict[str, Any] = {}
    # optimizer bytes per rank: (4 for the main copy + 8 for AdamW's two moments) per owned
    # element, exactly, under flat (plus one 4-byte step per piece)
    owned = sum(s.stop - s.start for s in zero.ownership.owned(rank))
    nbytes = sum(
        v.numel() * v.element_size()
        for s in zero.state.values()
        for k, v in s.items()
        if isinstance(v, torch.Tensor) and k != "step"
    )
    out["bytes"] = (nbytes, 12 * owned)
    sd = consolidated(zero, rank)
    assert sd is not None
    out["main_shapes"] = [
        (tuple(sd["state"][k][MAIN_KEY].shape), sd["state"][k][MAIN_KEY].dtype == torch.float32)
        for k in sorted(sd["state"])
    ]
    out["shapes"] = [tuple(p.shape) for p in model.parameters()]
    # one process loads it (another world size): the same main copy of every element
    single = ZeroRedundancyOptimizer(
        make_model(dtype=BF16).parameters(),
        torch.optim.AdamW,
        lr=1e-3,
        process_group=dist.new_group([rank]),
        main_params_dtype=torch.float32,
    )
    single.load_state_dict(sd)
    mains = zero.main_params()
    loaded = single.main_params()
    ps, qs = list(model.parameters()), list(single.param_groups[0]["params"])
    out["loaded_equal"] = all(
        torch.equal(
            loaded[qs[s.param]].reshape(-1)[s.start : s.stop], mains[ps[s.param]].reshape(-1)
        )
        for s in zero.ownership.owned(rank)
    )
    return out


def test_main_copies_in_state_dicts_and_memory_per_rank() -> None:
    for r in run_ranks(_state_worker, 2, timeout_s=120):
        nbytes, want = r["bytes"]
        assert nbytes == want
        assert r["main_shapes"] == [(s, True) for s in r["shapes"]]
        assert r["loaded_equal"]


def _load_plain_worker(rank: int, world_size: int) -> tuple[bool, list[str]]:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("zero_functional").addHandler(Keep())
    model = make_model(dtype=BF16)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 7, dtype=BF16)).float().sum().backward()
    plain.step()
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, lr=1e-3, main_params_dtype=torch.float32
    )
    zero.load_state_dict(plain.state_dict())
    zero.step()
    ok = all(
        torch.equal(p.detach(), m.to(BF16).view_as(p)) and m.dtype == torch.float32
        for p, m in zero.main_params().items()
    )
    return ok, records


def test_a_plain_bf16_state_dict_loads_with_one_warning() -> None:
    (ok, records), *_ = run_ranks(_load_plain_worker, 1, timeout_s=120)
    assert ok
    assert sum(MAIN_KEY in m for m in records) == 1, records


def test_main_params_dtype_is_checked() -> None:
    def build(**kw: Any) -> None:
        ZeroRedundancyOptimizer([torch.zeros(2, requires_grad=True)], torch.optim.SGD, **kw)

    # checks run before the process group is needed: the input's own error comes first
    with pytest.raises(ValueError, match="not wider"):
        build(lr=0.1, main_params_dtype=torch.float16)
    with pytest.raises(TypeError, match="torch.dtype"):
        build(lr=0.1, main_params_dtype="fp32")
    with pytest.raises(ValueError, match="elementwise"):
        ZeroRedundancyOptimizer(
            [torch.zeros(2, requires_grad=True)],
            torch.optim.LBFGS,
            main_params_dtype=torch.float32,
        )


def _refusals_worker(rank: int, world_size: int) -> list[str]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel.distributed import _MixedPrecision

    out: list[str] = []
    mixed = DDP(make_model(), mixed_precision=_MixedPrecision(param_dtype=BF16))
    zero = ZeroRedundancyOptimizer(mixed.parameters(), torch.optim.AdamW, overlap_with_ddp=True)
    plain = ZeroRedundancyOptimizer(mixed.parameters(), torch.optim.AdamW)
    for build in (
        lambda: hook_with_zero_step(allreduce_hook, mixed, zero),
        lambda: reduce_scatter_hook(mixed, plain),
        lambda: hook_with_zero_step(fp16_compress_hook, DDP(make_model()), zero, reduce_dtype=FP32),
        lambda: reduce_scatter_hook(DDP(make_model()), plain, reduce_dtype="fp32"),  # type: ignore[arg-type]
    ):
        try:
            build()
            out.append("accepted")
        except (TypeError, ValueError) as e:
            out.append(str(e))
    return out


def test_ddp_mixed_precision_and_bad_reduce_dtypes_are_refused() -> None:
    (mixed, mixed_rs, custom, bad), *_ = run_ranks(_refusals_worker, 1, timeout_s=120)
    assert "mixed_precision" in mixed and "main_params_dtype" in mixed
    assert "mixed_precision" in mixed_rs
    assert "custom hook" in custom and "fp16_compress_hook" in custom
    assert "reduce_dtype must be" in bad
