"""One prepared check of zero_functional on a CUDA GPU with NCCL: every mode, then step timings.

Nothing in this library had run on CUDA/NCCL before this script. On a machine with one GPU, from
the repository root (no network needed; stdlib, torch and ``src/`` only):

    PYTHONPATH=src PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT

Each part runs in spawned ranks (``zero_functional.app.launch.run_ranks``: process-group timeout
<= 60 s, and the ranks are killed at the part's limit), so a part that hangs or crashes is
reported and the next part runs; inside a part each check is caught on its own:

1. modes: every mode at 1 rank on NCCL (cuda:0), trained for a few steps under DDP and compared
   with DDP + the same ``torch.optim`` class and with torch's ``ZeroRedundancyOptimizer`` where
   torch has the mode (tolerance: the tests' 1e-6, times max(1, max |param|); one bf16 ulp for
   bf16): after backward under both partitions, bucket views, ``reduce_scatter_hook``, overlap
   mode (both hooks), ``overlap_param_gather``, AdamW / Adam / SGD with momentum,
   ``clip_grad_norm_``, GradScaler with fp16 autocast (overlap mode's ``grad_scaler=`` and
   ``scaler.step(opt)`` after backward, with injected overflows), the ``state_dict`` round trip,
   ``zero_functional.checkpoint``, a bf16 model, ``main_params_dtype`` where the optimizer has
   that keyword; then the comm paths a 1-rank run skips (coalesced rooted collectives, padded
   reduce-scatter / all-gather, sync units, twin group) and whether ``Pending.future`` (what
   ``reduce_scatter_hook`` hands DDP) is ordered on CUDA streams;
2. nccl2: whether NCCL takes 2 ranks on the one GPU (it usually refuses: "Duplicate GPU
   detected"); if it does, the modes run at 2 ranks too (after the timings);
3. timings: CUDA-event medians of the per-shard update kernels (ours foreach / fused, torch's
   AdamW / Adam / SGD foreach and fused) on GPT-2-small-shaped parameter lists (148 tensors,
   124.4M parameters) in fp32 and bf16, and of a whole ``ZeroRedundancyOptimizer.step()`` at
   1 rank against torch's ``ZeroRedundancyOptimizer`` and plain AdamW; each over torch's best
   variant measured in the same process;
4. compile: the ``compile=True`` kernels last, in their own ranks, within ``--compile-budget-s``
   (a group is not started past half of it; the ranks are killed 30 s after it); SKIP with the
   reason where compiling fails (the library then runs eager, with a warning) or runs out.

Each check prints ``PASS|FAIL|SKIP name: detail``; the end prints a Markdown summary (also in
``$OUT/gpu_check.md``, for the README) and a recap of every check that did not pass. Every row
is in ``$OUT/gpu_check.json``, this output in ``$OUT/gpu_check.log``, the ranks' own output
(warnings, NCCL messages, tracebacks) in ``$OUT/gpu_check_ranks.log``. Exit code 1 if any check
FAILed. The whole run stays within ``--budget-s`` (default 300 s; a part that would start with
under 20 s left is skipped); ``--parts`` runs some parts only.

Without a GPU, ``--cpu`` runs the same code on gloo with CPU tensors and smaller sizes (to test
the script: about 30-50 s on 2 cores); ``--quick`` takes fewer steps and rounds; ``--fault``
injects a failing check, a dying rank or a hanging rank, to test the reporting:

    PYTHONPATH=src python3 benchmarks/gpu_check.py --cpu --quick --out /tmp/gpu_check
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import importlib
import importlib.metadata
import inspect
import json
import logging
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:  # the documented command sets PYTHONPATH=src; be kind
    sys.path.insert(0, str(ROOT / "src"))

from _common import torch_step  # noqa: E402
from zero_functional import checkpoint, comm  # noqa: E402
from zero_functional.app.launch import LaunchError, run_ranks  # noqa: E402
from zero_functional.app.models import gpt2_shapes, total_numel  # noqa: E402
from zero_functional.functional import (  # noqa: E402
    adam_init,
    adam_update_,
    adamw_update_,
    sgd_init,
    sgd_update_,
)
from zero_functional.hooks import (  # noqa: E402
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    overlap_state,
    reduce_scatter_hook,
)
from zero_functional.optimizer import ZeroRedundancyOptimizer  # noqa: E402

Env = dict[str, Any]  # what every rank gets: sizes, paths, flags (picklable)
Row = dict[str, Any]

PARTS = ("modes", "nccl2", "timings", "compile")
RANK_ORDER = {"FAIL": 0, "SKIP": 1, "PASS": 2}
FP32_TOL = 1e-6  # the repo's tests' ATOL, scaled by max(1, max |param|)
CROSS_KERNEL_TOL = 1e-5  # ours (fused kernel) against torch's default (foreach / for-loop)

OPTS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "AdamW": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "Adam": (torch.optim.Adam, {"lr": 0.01}),
    "SGD": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}


# ============================================================================ shared helpers


def _emit(env: Env, row: Row) -> None:
    """Append one result row to the run's JSON-lines file (survives a rank that dies later)."""
    row.setdefault("rank", dist.get_rank() if dist.is_initialized() else 0)
    row.setdefault("world", dist.get_world_size() if dist.is_initialized() else 1)
    with open(env["rows"], "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def _redirect(env: Env, tag: str, rank: int) -> None:
    """Send this rank's stdout and stderr (warnings, NCCL messages) to a log file of the run."""
    path = os.path.join(env["tmp"], f"{tag}.rank{rank}.log")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    print(f"== {tag} rank {rank} started {datetime.datetime.now():%H:%M:%S}", flush=True)


def _device(env: Env) -> torch.device:
    if env["cpu"]:
        return torch.device("cpu")
    # one GPU: every rank on cuda:0 (NCCL may refuse 2 ranks there); more: one rank per GPU
    rank = dist.get_rank() if dist.is_initialized() else 0
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _brief(tb: str) -> str:
    """The exception line of a traceback, and where in zero_functional it was raised."""
    lines = [line for line in tb.strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "?"
    where = ""
    for line in lines:
        s = line.strip()
        if s.startswith('File "') and "zero_functional" in s:
            parts = s.split('"')
            lineno = s.split("line ")[-1].split(",")[0] if "line " in s else "?"
            where = f"{os.path.basename(parts[1])}:{lineno}"
    return f"{last[:300]}" + (f" (last in zero_functional: {where})" if where else "")


def _guarded(env: Env, part: str, name: str, fn: Callable[[], Row]) -> None:
    """Run one check; a failure becomes a FAIL row with the traceback, and the run goes on."""
    t0 = time.monotonic()
    try:
        row = fn()
    except Exception:
        tb = traceback.format_exc()
        print(tb, flush=True)  # into the rank's log
        row = {"status": "FAIL", "detail": _brief(tb), "traceback": tb[-4000:]}
    row.update(part=part, name=name, seconds=round(time.monotonic() - t0, 2))
    _emit(env, row)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1e}"


# ============================================================================ part 1: modes


class Net(nn.Module):
    """A small MLP with a LayerNorm (four modules with parameters, eight tensors)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.norm = nn.LayerNorm(width)
        self.mid = nn.Linear(width, width)
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.inp(x)))
        return self.out(torch.tanh(self.mid(h)))


def _net(env: Env, dtype: torch.dtype, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net(env["width"]).to(device=_device(env), dtype=dtype)


def _ddp(model: nn.Module, cap: float = 25.0) -> DDP:
    p = next(model.parameters())
    ids = [p.device.index] if p.device.type == "cuda" else None
    return DDP(model, device_ids=ids, bucket_cap_mb=cap)


def _batch(
    env: Env, step: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the step's global batch of 16 rows (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)
    rank, world = dist.get_rank(), dist.get_world_size()
    per = 16 // world
    sl = slice(rank * per, (rank + 1) * per)
    dev = _device(env)
    return x[sl].to(dev, dtype), y[sl].to(dev, dtype)


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (pa.detach().double() - pb.detach().double()).abs().max().item()
        for pa, pb in zip(a.parameters(), b.parameters())
    )


def _scale(m: nn.Module) -> float:
    return max(p.detach().double().abs().max().item() for p in m.parameters())


def _tol(dtype: torch.dtype, scale: float, base: float = FP32_TOL) -> float:
    if dtype == torch.bfloat16:  # one bf16 ulp at the largest parameter
        return torch.finfo(torch.bfloat16).eps * max(1.0, scale)
    return base * max(1.0, scale)


def _poison_once() -> Callable[[torch.Tensor], torch.Tensor | None]:
    """A gradient hook that puts one inf into the gradient, once (an overflow under fp16)."""
    done = [False]

    def hook(grad: torch.Tensor) -> torch.Tensor | None:
        if done[0]:
            return None
        done[0] = True
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    return hook


class Side:
    """One trained copy: model, DDP, optimizer, how it steps, and its scaler."""

    def __init__(
        self,
        model: nn.Module,
        ddp: DDP,
        opt: Any,
        *,
        in_backward: bool = False,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self.model, self.ddp, self.opt = model, ddp, opt
        self.in_backward = in_backward  # overlap mode: the step runs inside backward
        self.scaler = scaler
        self.norms: list[float] = []
        self.scales: list[float] = []


def _iterate(
    env: Env, side: Side, step: int, *, clip: float | None, amp: bool, poison: bool
) -> None:
    dtype = next(side.model.parameters()).dtype
    x, y = _batch(env, step, dtype)
    side.opt.zero_grad()
    device_type = "cpu" if env["cpu"] else "cuda"
    with torch.autocast(device_type, dtype=torch.float16, enabled=amp):
        out = side.ddp(x)
    loss = ((out.float() - y.float()) ** 2).mean()
    if poison:
        side.model.mid.weight.register_hook(_poison_once())
    if side.scaler is not None:
        side.scaler.scale(loss).backward()
    else:
        loss.backward()
    if not side.in_backward:
        if clip is not None:
            if isinstance(side.opt, ZeroRedundancyOptimizer):
                norm = side.opt.clip_grad_norm_(clip)
            else:
                norm = torch.nn.utils.clip_grad_norm_(side.model.parameters(), clip)
            side.norms.append(float(norm))
        if side.scaler is not None:
            side.scaler.step(side.opt)
        else:
            side.opt.step()
    if side.scaler is not None:
        side.scaler.update()
        side.scales.append(side.scaler.get_scale())


def _case(
    env: Env,
    *,
    opt: str = "AdamW",
    mode: str = "after",  # after | rs_hook | overlap | overlap_il
    partition: str = "sorted_greedy",
    bucket_view: bool = False,
    gather: bool = False,
    clip: float | None = None,
    amp: bool = False,
    dtype: torch.dtype = torch.float32,
    cap: float = 25.0,
    torch_ref: bool = True,
    fused: bool = True,
    tol: float = FP32_TOL,
) -> Row:
    """Train ours, DDP + plain, and (where torch has the mode) torch's ZeRO; compare."""
    cls, kw = OPTS[opt]
    kw = dict(kw)
    if fused and opt != "SGD":
        kw["fused"] = True  # the kernel ours runs by default, on every side: same arithmetic
    overlap = mode.startswith("overlap")
    models = [_net(env, dtype) for _ in range(3 if torch_ref else 2)]
    ddps = [_ddp(m, cap) for m in models]
    device_type = "cpu" if env["cpu"] else "cuda"
    scalers = [
        torch.amp.GradScaler(device_type, init_scale=2.0**10, growth_interval=2) if amp else None
        for _ in models
    ]
    ours = ZeroRedundancyOptimizer(
        ddps[0].parameters(),
        cls,
        overlap_with_ddp=overlap,
        partition=partition,  # type: ignore[arg-type]
        parameters_as_bucket_view=bucket_view,
        overlap_param_gather=True if gather else None,
        **kw,
    )
    if overlap:
        wrap = hook_with_zero_step_interleaved if mode == "overlap_il" else hook_with_zero_step
        ddps[0].register_comm_hook(
            None, wrap(allreduce_hook, ddps[0], ours, grad_scaler=scalers[0])
        )
    elif mode == "rs_hook":
        ddps[0].register_comm_hook(None, reduce_scatter_hook(ddps[0], ours, grad_scaler=scalers[0]))
    sides = [
        Side(models[0], ddps[0], ours, in_backward=overlap, scaler=scalers[0]),
        Side(models[1], ddps[1], cls(ddps[1].parameters(), **kw), scaler=scalers[1]),
    ]
    if torch_ref:
        theirs = TorchZero(ddps[2].parameters(), cls, parameters_as_bucket_view=bucket_view, **kw)
        sides.append(Side(models[2], ddps[2], theirs, scaler=scalers[2]))
    world, rank = dist.get_world_size(), dist.get_rank()
    poison_at = {2, 5} if amp else set()
    for step in range(env["steps"]):
        poison = step in poison_at and rank == world - 1
        for side in sides:
            _iterate(env, side, step, clip=clip, amp=amp, poison=poison)
    ours.finish_param_sync()
    vs_plain = _max_diff(models[0], models[1])
    vs_torch = _max_diff(models[0], models[2]) if torch_ref else None
    limit = _tol(dtype, _scale(models[1]), tol)
    ok = vs_plain <= limit and (vs_torch is None or vs_torch <= limit)
    detail = f"max |diff| vs DDP+{opt} {_fmt(vs_plain)}"
    detail += f", vs torch ZeRO {_fmt(vs_torch)}" if torch_ref else ", torch ZeRO: no such mode"
    detail += f" (tol {limit:.1e})"
    row: Row = {"vs_plain": vs_plain, "vs_torch": vs_torch, "tol": limit}
    if clip is not None:
        worst = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(sides[0].norms, sides[1].norms))
        ok = ok and worst <= 1e-5
        clipped = sum(n > clip for n in sides[1].norms)
        detail += f"; norms rel diff {_fmt(worst)}, clipped {clipped}/{len(sides[1].norms)} steps"
        row["norm_rel_diff"] = worst
    if amp:
        same = all(s.scales == sides[1].scales for s in sides)
        lowered = any(b < a for a, b in zip(sides[1].scales, sides[1].scales[1:]))
        ok = ok and same and lowered
        detail += f"; scales equal on every side: {same}, lowered by the overflow: {lowered}"
        if overlap:
            state = overlap_state(ours)
            skipped = state.skipped if state is not None else -1
            ok = ok and skipped == len(poison_at & set(range(env["steps"])))
            detail += f", skipped {skipped}"
        row["scales"] = sides[0].scales
    row.update(status="PASS" if ok else "FAIL", detail=detail)
    return row


def _train_steps(env: Env, pairs: list[tuple[DDP, Any]], steps: range) -> None:
    for step in steps:
        for ddp, opt in pairs:
            opt.zero_grad()
            x, y = _batch(env, step, next(ddp.parameters()).dtype)
            ((ddp(x) - y) ** 2).mean().backward()
            opt.step()


def _state_dict_case(env: Env, partition: str) -> Row:
    """Consolidate, compare with the plain optimizer's state, load into ours (the other
    partition) and into plain AdamW, train on: all three must follow the plain run."""
    cls, kw = OPTS["AdamW"]
    kw = {**kw, "fused": True}
    other = "flat" if partition == "sorted_greedy" else "sorted_greedy"
    m_ours, m_plain = _net(env, torch.float32), _net(env, torch.float32)
    d_ours, d_plain = _ddp(m_ours), _ddp(m_plain)
    ours = ZeroRedundancyOptimizer(d_ours.parameters(), cls, partition=partition, **kw)  # type: ignore[arg-type]
    plain = cls(d_plain.parameters(), **kw)
    half = env["steps"] // 2
    _train_steps(env, [(d_ours, ours), (d_plain, plain)], range(half))
    ours.consolidate_state_dict(to=0)
    box = [ours.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    sd = box[0]
    assert sd is not None
    ref = plain.state_dict()
    assert sorted(sd["state"]) == sorted(ref["state"]), (sorted(sd["state"]), sorted(ref["state"]))
    state_diff = 0.0
    for i, s in ref["state"].items():
        assert set(sd["state"][i]) == set(s), (i, set(sd["state"][i]), set(s))
        for k, v in s.items():
            a = torch.as_tensor(sd["state"][i][k]).double().cpu()
            state_diff = max(state_diff, (a - torch.as_tensor(v).double().cpu()).abs().max().item())
    m_res = _net(env, torch.float32, seed=99)
    m_res.load_state_dict(m_ours.state_dict())
    m_int = copy.deepcopy(m_res)
    d_res, d_int = _ddp(m_res), _ddp(m_int)
    resumed = ZeroRedundancyOptimizer(
        d_res.parameters(),
        cls,
        partition=other,  # type: ignore[arg-type]
        **{**kw, "lr": 0.5},
    )
    resumed.load_state_dict(copy.deepcopy(sd))
    lr_ok = resumed.param_groups[0]["lr"] == kw["lr"]
    interop = cls(d_int.parameters(), **{**kw, "lr": 0.5})
    interop.load_state_dict(copy.deepcopy(sd))
    _train_steps(
        env, [(d_res, resumed), (d_int, interop), (d_plain, plain)], range(half, env["steps"])
    )
    resumed.finish_param_sync()
    vs_plain, int_plain = _max_diff(m_res, m_plain), _max_diff(m_int, m_plain)
    limit = _tol(torch.float32, _scale(m_plain))
    ok = state_diff <= limit and vs_plain <= limit and int_plain <= limit and lr_ok
    detail = (
        f"consolidated state vs plain AdamW {_fmt(state_diff)}; loaded into ours ({other}) "
        f"and trained on: vs plain {_fmt(vs_plain)}; loaded into plain AdamW: {_fmt(int_plain)}; "
        f"lr restored: {lr_ok} (tol {limit:.1e})"
    )
    return {"status": "PASS" if ok else "FAIL", "detail": detail, "state_diff": state_diff}


def _checkpoint_case(env: Env, save_partition: str, load_partition: str) -> Row:
    """checkpoint.save under one partition, load into a fresh model and ours under the other,
    train on: equal to the uninterrupted run and to DDP + plain AdamW."""
    cls, kw = OPTS["AdamW"]
    kw = {**kw, "fused": True}
    world = dist.get_world_size()
    path = os.path.join(env["tmp"], f"ckpt-w{world}-{save_partition}")
    m_a, m_p = _net(env, torch.float32), _net(env, torch.float32)
    d_a, d_p = _ddp(m_a), _ddp(m_p)
    a = ZeroRedundancyOptimizer(d_a.parameters(), cls, partition=save_partition, **kw)  # type: ignore[arg-type]
    p = cls(d_p.parameters(), **kw)
    half = env["steps"] // 2
    _train_steps(env, [(d_a, a), (d_p, p)], range(half))
    t0 = time.monotonic()
    checkpoint.save(path, model=d_a, optimizer=a, extra={"step": half})
    save_s = time.monotonic() - t0
    m_b = _net(env, torch.float32, seed=99)
    d_b = _ddp(m_b)
    b = ZeroRedundancyOptimizer(d_b.parameters(), cls, partition=load_partition, **kw)  # type: ignore[arg-type]
    t0 = time.monotonic()
    extra = checkpoint.load(path, model=d_b, optimizer=b)
    load_s = time.monotonic() - t0
    on_device = all(
        v.device == q.device
        for q, s in b.state.items()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    _train_steps(env, [(d_a, a), (d_b, b), (d_p, p)], range(half, env["steps"]))
    a.finish_param_sync()
    b.finish_param_sync()
    vs_a, vs_p = _max_diff(m_b, m_a), _max_diff(m_b, m_p)
    limit = _tol(torch.float32, _scale(m_p))
    ok = vs_a <= limit and vs_p <= limit and extra == {"step": half} and on_device
    detail = (
        f"saved ({save_partition}) {save_s:.2f} s, loaded ({load_partition}) {load_s:.2f} s; "
        f"trained on: vs uninterrupted {_fmt(vs_a)}, vs DDP+AdamW {_fmt(vs_p)}; extra "
        f"{extra!r}; loaded state on the parameters' device: {on_device} (tol {limit:.1e})"
    )
    return {"status": "PASS" if ok else "FAIL", "detail": detail, "vs_plain": vs_p}


def _main_params_case(env: Env) -> Row:
    """bf16 model, fp32 main parameters and state (where the keyword exists)."""
    params = inspect.signature(ZeroRedundancyOptimizer.__init__).parameters
    if "main_params_dtype" not in params:
        return {
            "status": "SKIP",
            "detail": "ZeroRedundancyOptimizer has no main_params_dtype keyword in this version",
        }
    cls, kw = OPTS["AdamW"]
    m_ours, m_ref, m_bf = (_net(env, torch.bfloat16) for _ in range(3))
    d_ours, d_ref, d_bf = _ddp(m_ours), _ddp(m_ref), _ddp(m_bf)
    ours = ZeroRedundancyOptimizer(
        d_ours.parameters(),
        cls,
        main_params_dtype=torch.float32,
        **kw,
    )
    mains = [p.detach().float().clone() for p in m_ref.parameters()]
    ref = cls(mains, fused=True, **kw)
    bf = cls(d_bf.parameters(), fused=True, **kw)
    for step in range(env["steps"]):
        _train_steps(env, [(d_ours, ours), (d_bf, bf)], range(step, step + 1))
        ref.zero_grad()
        x, y = _batch(env, step, torch.bfloat16)
        ((d_ref(x) - y) ** 2).mean().backward()
        for main, p in zip(mains, m_ref.parameters()):
            main.grad = p.grad.float()  # type: ignore[union-attr]
        ref.step()
        with torch.no_grad():
            for main, p in zip(mains, m_ref.parameters()):
                p.copy_(main)
                p.grad = None
    ours.finish_param_sync()
    vs_ref = _max_diff(m_ours, m_ref)
    bf_ref = _max_diff(m_bf, m_ref)
    limit = _tol(torch.bfloat16, _scale(m_ref))
    dtypes = sorted(
        {
            str(v.dtype)
            for s in ours.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        }
    )
    ok = vs_ref <= limit
    detail = (
        f"vs bf16 model + fp32 main params and fused AdamW by hand {_fmt(vs_ref)} (tol "
        f"{limit:.1e}); plain bf16 AdamW is {_fmt(bf_ref)} from it; ours' state dtypes {dtypes}"
    )
    return {"status": "PASS" if ok else "FAIL", "detail": detail, "vs_plain": vs_ref}


def _compressed_case(env: Env) -> Row:
    """Compressed collectives (issue 41) on the device: each wire format's round trip within its
    bound; from 2 ranks the encoded all-to-all reduce (uint8 ``all_to_all_single``) against the
    exact sum, and int8 both ways through ``reduce_scatter_hook``: parameters equal on every rank."""
    if "gather_dtype" not in inspect.signature(ZeroRedundancyOptimizer.__init__).parameters:
        return {"status": "SKIP", "detail": "no gather_dtype keyword in this version"}
    from zero_functional import comm
    from zero_functional.comm.exchange import start_exchange

    dev, world, rank = _device(env), dist.get_world_size(), dist.get_rank()
    worst, notes = 0.0, []
    for dtype in comm.WIRE_DTYPES:
        codec = comm.Codec(dtype)
        x = torch.randn(3000, generator=torch.Generator().manual_seed(rank)).to(dev)
        error = (codec.decode(codec.encode(x), x.numel()) - x).abs()
        worst = max(
            worst, float((error / (codec.rounding_bound(x) + 4 * 2.0**-24 * x.abs() + 1e-30)).max())
        )
        if world > 1:
            runs = [(a * 3000 // world, (a + 1) * 3000 // world, a) for a in range(world)]
            values = [
                torch.randn(3000, generator=torch.Generator().manual_seed(r)).to(dev)
                for r in range(world)
            ]
            buffer = values[rank].clone()
            start_exchange(buffer, runs, dist.group.WORLD, None, codec).wait()
            a, b, _ = runs[rank]
            bound = sum(codec.rounding_bound(v[a:b]) for r, v in enumerate(values) if r != rank)
            exact = sum(v[a:b].double() for v in values)
            ratio = float(
                (
                    (buffer[a:b].double() - exact).abs()
                    / (bound + 8 * 2.0**-24 * exact.abs() + 1e-30)
                ).max()
            )
            worst = max(worst, ratio)
    if world > 1:
        model = _net(env, torch.float32)
        ddp = _ddp(model, cap=0.01)
        cls, kw = OPTS["AdamW"]
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(), cls, partition="flat", gather_dtype=torch.int8, **kw
        )
        ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero, wire_dtype=torch.int8))
        _train_steps(env, [(ddp, zero)], range(env["steps"]))
        zero.finish_param_sync()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        equal = all(torch.equal(g, flat) for g in gathered)
        notes.append(f"int8 both ways: parameters {'equal' if equal else 'DIFFER'} on every rank")
    else:
        equal = True
        notes.append("1 rank: nothing crosses (the codec alone)")
    ok = worst <= 1.0 and equal
    detail = f"worst error / bound {worst:.3f} over {len(comm.WIRE_DTYPES)} formats; " + "; ".join(
        notes
    )
    return {"status": "PASS" if ok else "FAIL", "detail": detail}


def _collectives_case(env: Env) -> Row:
    """The comm paths NCCL takes that a 1-rank training run skips (step(), the hooks and
    reduce_scatter_hook do no collective at 1 rank): reduce_scatter_single / all_gather_single
    on padded buffers, several reduces and broadcasts in one coalesced launch
    (``_coalescing_manager``), the parameter sync's units, a twin group, the scalar collectives."""
    group = dist.group.WORLD
    assert group is not None
    dev = _device(env)
    world, rank = dist.get_world_size(), dist.get_rank()
    n = env["coll_numel"]
    base = (torch.arange(n, device=dev) % 1000).float()
    expected = base * world + sum(range(world))
    chunk = -(-n // world) + 3  # not a divisor of n: the padded path
    runs = tuple((r * chunk, min(n, (r + 1) * chunk), r) for r in range(world) if r * chunk < n)
    split = tuple(  # each run in two pieces: several rooted calls, coalesced on NCCL
        piece
        for a, b, r in runs
        for piece in ((a, (a + b) // 2, r), ((a + b) // 2, b, r))
        if piece[0] < piece[1]
    )
    mine = [(a, b) for a, b, r in split if r == rank]
    bad: list[str] = []

    def same(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got, want):
            bad.append(f"{label}: max |diff| {(got - want).abs().max().item():.3g}")

    for label, pieces, ch in (
        ("reduce_scatter_single", runs, chunk),
        ("reduce x2/rank", split, None),
    ):
        buf = base + rank
        pending = comm.start_reduce(buf, pieces, group, chunk=ch)
        inline = ch is None and comm.Wire(group, threaded=False).exchanges(buf.device)
        if not pending.works and not inline:  # gloo's exchange without a thread is done already
            bad.append(f"{label}: no work handle to wait for")
        pending.wait()
        for a, b in mine:
            same(label, buf[a:b], expected[a:b])
        buf = base + rank
        got = comm.start_reduce(buf, pieces, group, chunk=ch).future(buf).wait()
        for a, b in mine:
            same(f"{label} through Pending.future", got[a:b], expected[a:b])
    for label, pieces, ch in (
        ("all_gather_single", runs, chunk),
        ("broadcast x2/rank", split, None),
    ):
        buf = torch.full_like(base, -1.0)
        for a, b in mine:
            buf[a:b] = expected[a:b]
        comm.start_broadcast(buf, pieces, group, chunk=ch).wait()
        same(label, buf, expected)
    sizes = [comm.COALESCE_BELOW + 5, 10, 20, comm.COALESCE_BELOW, 7]
    owners = [i % world for i in range(len(sizes))]
    tensors = [torch.full((s,), float(i + 100 * rank), device=dev) for i, s in enumerate(sizes)]
    pending = comm.start_sync_params(tensors, owners, group)
    units = len(pending.works)
    pending.wait()
    for i, (t, o) in enumerate(zip(tensors, owners)):
        same(f"sync unit {i}", t, torch.full_like(t, float(i + 100 * o)))
    twin = comm.twin_group(group)
    t = torch.ones(1, device=dev)
    dist.all_reduce(t, group=twin)
    same("twin group all_reduce", t, torch.full_like(t, float(world)))
    flags = torch.tensor([rank == 0, False], device=dev)
    same("any_rank", comm.any_rank(flags, group).float(), torch.tensor([1.0, 0.0], device=dev))
    gathered = comm.all_gather_scalar(torch.tensor(float(rank), device=dev), group)
    same("all_gather_scalar", gathered, torch.arange(world, device=dev).float())
    top = comm.all_reduce_scalar(torch.tensor(float(rank), device=dev), group, op="max")
    same("all_reduce_scalar max", top, torch.tensor(float(world - 1), device=dev))
    detail = (
        f"{n:,} float32 on {dev}: reduce_scatter_single + all_gather_single (padded), reduces "
        f"and broadcasts x{len(split)} ({'one coalesced launch' if comm.is_nccl(group) else 'one call each'}), "
        f"{units} sync broadcast(s), twin group, scalar collectives"
    )
    if bad:
        return {"status": "FAIL", "detail": detail + "; wrong: " + "; ".join(bad[:4])}
    return {"status": "PASS", "detail": detail + ": every value as expected"}


def _future_streams_case(env: Env) -> Row:
    """Is the future ``comm.Pending.future`` returns (what ``reduce_scatter_hook`` hands DDP)
    ordered on CUDA streams like NCCL's own futures? A future whose callbacks run on the side
    stream its source chose is stream-aware; one that runs them on the default stream
    (``collect_all``'s result is a CPU future) lets DDP read the bucket before NCCL (or the
    copy-back from a padded buffer) has written it."""
    dev = _device(env)
    if dev.type != "cuda":
        return {"status": "SKIP", "detail": "CPU tensors: no streams to order"}
    group = dist.group.WORLD
    assert group is not None
    default = torch.cuda.default_stream(dev)

    def stream_of(fut: Any) -> bool:
        seen: list[bool] = []
        fut.then(lambda _: seen.append(torch.cuda.current_stream(dev) != default)).wait()
        return seen[0]

    n = 1 << 20
    world = dist.get_world_size()
    work = dist.all_reduce(torch.ones(n, device=dev), async_op=True)
    assert work is not None
    nccl_side = stream_of(work.get_future())
    buf = torch.ones(n, device=dev)
    runs = ((0, n // 2, 0), (n // 2, n, world - 1))
    pending = comm.start_reduce(buf, runs, group)
    try:  # what Pending.future does: collect_all over the works' futures, if they have them
        chained = bool([w.get_future() for w in pending.works])
    except RuntimeError:
        chained = False  # no futures: Pending.future waits for the works itself (ordered)
    ours_side = stream_of(pending.future(buf))
    detail = (
        f"callbacks on a side stream: NCCL's work future {nccl_side}, Pending.future() "
        f"(reduce_scatter_hook's) {ours_side}; "
        + ("chained on the works' futures" if chained else "waited for the works itself")
    )
    if nccl_side and chained and not ours_side:
        return {
            "status": "FAIL",
            "detail": detail + ": the future DDP gets is not stream-ordered after the NCCL "
            "reduces (collect_all makes a CPU future), so on 2+ ranks DDP may read gradients "
            "before they are reduced",
        }
    return {"status": "PASS", "detail": detail}


def _mode_cases(env: Env) -> list[tuple[str, Callable[[], Row]]]:
    """Every check of part 1, as (name, thunk)."""
    bf16 = torch.bfloat16

    def c(**kw: Any) -> Callable[[], Row]:
        return lambda: _case(env, **kw)

    cases: list[tuple[str, Callable[[], Row]]] = [
        ("after-backward sorted_greedy AdamW", c()),
        ("after-backward flat AdamW", c(partition="flat")),
        ("bucket view sorted_greedy AdamW", c(bucket_view=True)),
        ("bucket view flat AdamW", c(partition="flat", bucket_view=True)),
        ("reduce_scatter_hook flat AdamW", c(mode="rs_hook", partition="flat")),
        ("reduce_scatter_hook sorted_greedy AdamW", c(mode="rs_hook")),
        (
            "overlap hook_with_zero_step sorted_greedy Adam",
            c(opt="Adam", mode="overlap", torch_ref=False),
        ),
        (
            "overlap hook_with_zero_step flat AdamW",
            c(mode="overlap", partition="flat", torch_ref=False),
        ),
        (
            "overlap interleaved sorted_greedy AdamW, 1 bucket/param",
            c(mode="overlap_il", cap=1e-4, torch_ref=False),
        ),
        (
            "overlap interleaved flat SGD, 1 bucket/param",
            c(opt="SGD", mode="overlap_il", partition="flat", cap=1e-4, torch_ref=False),
        ),
        (
            "overlap_param_gather reduce_scatter_hook flat AdamW",
            c(mode="rs_hook", partition="flat", gather=True),
        ),
        (
            "overlap_param_gather overlap interleaved flat AdamW",
            c(mode="overlap_il", partition="flat", gather=True, cap=1e-4, torch_ref=False),
        ),
        ("after-backward sorted_greedy Adam", c(opt="Adam")),
        ("after-backward sorted_greedy SGD momentum", c(opt="SGD")),
        ("after-backward flat SGD momentum", c(opt="SGD", partition="flat")),
        (
            "torch defaults AdamW (ours fused vs torch's default kernel)",
            c(fused=False, tol=CROSS_KERNEL_TOL),
        ),
        ("clip_grad_norm_ sorted_greedy AdamW", c(clip=0.05)),
        (
            "clip_grad_norm_ reduce_scatter_hook flat AdamW",
            c(mode="rs_hook", partition="flat", clip=0.05),
        ),
        (
            "GradScaler fp16 overlap hook grad_scaler= sorted_greedy Adam",
            c(opt="Adam", mode="overlap", amp=True, torch_ref=False),
        ),
        (
            "GradScaler fp16 overlap interleaved grad_scaler= flat AdamW",
            c(mode="overlap_il", partition="flat", amp=True, cap=1e-4, torch_ref=False),
        ),
        ("GradScaler fp16 scaler.step(opt) sorted_greedy AdamW", c(amp=True)),
        (
            "GradScaler fp16 scaler.step(opt) reduce_scatter_hook(grad_scaler=) flat AdamW",
            c(mode="rs_hook", partition="flat", amp=True),
        ),
        ("state_dict round trip sorted_greedy", lambda: _state_dict_case(env, "sorted_greedy")),
        ("state_dict round trip flat", lambda: _state_dict_case(env, "flat")),
        (
            "checkpoint save sorted_greedy, load flat",
            lambda: _checkpoint_case(env, "sorted_greedy", "flat"),
        ),
        (
            "checkpoint save flat, load sorted_greedy",
            lambda: _checkpoint_case(env, "flat", "sorted_greedy"),
        ),
        ("bf16 model AdamW sorted_greedy", c(dtype=bf16)),
        (
            "bf16 model AdamW flat reduce_scatter_hook",
            c(dtype=bf16, mode="rs_hook", partition="flat"),
        ),
        (
            "bf16 model AdamW overlap flat",
            c(dtype=bf16, mode="overlap", partition="flat", torch_ref=False),
        ),
        ("bf16 model, main_params_dtype=float32", lambda: _main_params_case(env)),
        ("compressed collectives (wire_dtype, gather_dtype int8)", lambda: _compressed_case(env)),
        # last: a broken NCCL path can take the process down with it
        ("comm paths (coalesced, padded, twin group, scalars)", lambda: _collectives_case(env)),
        ("Pending.future stream ordering on CUDA", lambda: _future_streams_case(env)),
    ]
    if "case" in env["fault"]:
        cases.insert(1, ("injected fault (--fault case)", _injected_fault))
    return cases


def _injected_fault() -> Row:
    raise RuntimeError("injected by --fault case")


def _modes_worker(rank: int, world_size: int, env: Env) -> int:
    _redirect(env, f"modes-w{world_size}", rank)
    _device(env)
    cases = _mode_cases(env)
    for name, fn in cases:
        _guarded(env, "modes", name, fn)
        print(f"done: {name}", flush=True)
    return len(cases)


def _probe_worker(rank: int, world_size: int, env: Env) -> float:
    """Two ranks on the one device: does the backend take them (NCCL: one rank per GPU)?"""
    _redirect(env, "nccl2", rank)
    dev = _device(env)
    if "hang" in env["fault"]:
        time.sleep(3600)
    t = torch.ones(1, device=dev)
    dist.all_reduce(t)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return float(t.item())


# ============================================================================ part 2: timings


def _shapes(env: Env) -> list[tuple[int, ...]]:
    layers, width, vocab, ctx = env["gpt2"]
    return gpt2_shapes(layers, width, vocab_size=vocab, n_positions=ctx)


def _tensors(env: Env, dtype: torch.dtype, scale: float, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    dev = _device(env)
    return [(torch.randn(s, device=dev) * scale).to(dtype) for s in _shapes(env)]


Step = Callable[[], object]


def _ours_kernel(
    update: Callable[..., None],
    init: Callable[[list[torch.Tensor]], Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    **kw: Any,
) -> Step:
    ps = [p.clone() for p in params]
    state = init(ps)
    return lambda: update(ps, grads, state, **kw)


def _kernel_variants(
    name: str, params: list[torch.Tensor], grads: list[torch.Tensor], compiled: bool
) -> dict[str, Callable[[], Step]]:
    """Builders of each variant's step (built one at a time, so one failing is one row)."""
    if name == "SGD momentum":
        kw: dict[str, Any] = {"lr": 1e-3, "momentum": 0.9}
        out: dict[str, Callable[[], Step]] = {
            "torch SGD foreach": lambda: torch_step(
                torch.optim.SGD, params, grads, foreach=True, **kw
            ),
            "torch SGD fused": lambda: torch_step(torch.optim.SGD, params, grads, fused=True, **kw),
            "ours sgd_update_ (foreach, default)": lambda: _ours_kernel(
                sgd_update_, sgd_init, params, grads, **kw
            ),
        }
        if compiled:
            out["ours sgd_update_ compile=True"] = lambda: _ours_kernel(
                sgd_update_, sgd_init, params, grads, compile=True, **kw
            )
        return out
    cls = torch.optim.AdamW if name == "AdamW" else torch.optim.Adam
    update = adamw_update_ if name == "AdamW" else adam_update_
    kw = {"lr": 1e-3, "weight_decay": 0.01} if name == "AdamW" else {"lr": 1e-3}
    low = name.lower()
    out = {
        f"torch {name} foreach": lambda: torch_step(cls, params, grads, foreach=True, **kw),
        f"torch {name} fused": lambda: torch_step(cls, params, grads, fused=True, **kw),
        f"ours {low}_update_ fused=False (foreach)": lambda: _ours_kernel(
            update, adam_init, params, grads, fused=False, **kw
        ),
        f"ours {low}_update_ default (fused)": lambda: _ours_kernel(
            update, adam_init, params, grads, **kw
        ),
    }
    if compiled:
        out[f"ours {low}_update_ compile=True"] = lambda: _ours_kernel(
            update, adam_init, params, grads, compile=True, **kw
        )
    return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _time(steps: dict[str, Step], rounds: int, warmup: int, dev: torch.device) -> dict[str, float]:
    """Median ms per step, variants interleaved round by round (CUDA events on the GPU)."""
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    _sync(dev)
    times: dict[str, list[float]] = {n: [] for n in steps}
    for _ in range(rounds):
        if dev.type == "cuda":
            events = {}
            for n, fn in steps.items():
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                events[n] = (start, end)
            torch.cuda.synchronize()
            for n, (start, end) in events.items():
                times[n].append(start.elapsed_time(end))
        else:
            for n, fn in steps.items():
                t0 = time.perf_counter()
                fn()
                times[n].append((time.perf_counter() - t0) * 1e3)
    return {n: statistics.median(t) for n, t in times.items()}


class _Warnings(logging.Handler):
    """Collects the warnings zero_functional logs (e.g. a compiled update falling back)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _captured_warnings() -> Iterator[_Warnings]:
    handler = _Warnings()
    log = logging.getLogger("zero_functional")
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)


def _build(
    env: Env, group: str, builders: dict[str, Callable[[], Step]], dev: torch.device, run: str
) -> dict[str, Step]:
    """Build each variant and take one step; a variant that fails is a row, not the group."""
    steps: dict[str, Step] = {}
    for name, build in builders.items():
        t0 = time.monotonic()
        try:
            with _captured_warnings() as caught:
                fn = build()
                fn()
                _sync(dev)
            first_s = time.monotonic() - t0
            if "compile" in name:
                if caught.messages:
                    _emit(
                        env,
                        _timing_row(
                            run,
                            group,
                            name,
                            status="SKIP",
                            detail="compiling "
                            f"failed, the eager update ran instead: {caught.messages[0][:300]}",
                        ),
                    )
                    continue
                _emit(
                    env,
                    _timing_row(
                        run,
                        group,
                        name + " (first call)",
                        status="PASS",
                        detail=f"first call (trace + compile) {first_s:.1f} s",
                        first_s=first_s,
                    ),
                )
            steps[name] = fn
        except Exception:
            tb = traceback.format_exc()
            print(tb, flush=True)
            status = "SKIP" if name.startswith("torch") else "FAIL"
            _emit(
                env,
                _timing_row(
                    run, group, name, status=status, detail=_brief(tb), traceback=tb[-4000:]
                ),
            )
    return steps


def _timing_row(run: str, group: str, name: str, **kw: Any) -> Row:
    return {
        "part": "timings" if run == "eager" else "compile",
        "run": run,
        "group": group,
        "name": name,
        **kw,
    }


def _time_group(
    env: Env, run: str, group: str, builders: dict[str, Callable[[], Step]], dev: torch.device
) -> None:
    steps = _build(env, group, builders, dev, run)
    if not steps:
        return
    try:
        med = _time(steps, env["rounds"], env["warmup"], dev)
    except Exception:
        tb = traceback.format_exc()
        _emit(env, _timing_row(run, group, "timing", status="FAIL", detail=_brief(tb)))
        return
    for name, ms in med.items():
        _emit(env, _timing_row(run, group, name, status="PASS", ms=ms))
    del steps
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _whole_step_builders(
    params: list[torch.Tensor], grads: list[torch.Tensor], compiled: bool
) -> dict[str, Callable[[], Step]]:
    kw: dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.01}
    adamw = torch.optim.AdamW

    def zero(cls: type, **extra: Any) -> Step:
        ps = [nn.Parameter(p.clone()) for p in params]
        for p, g in zip(ps, grads):
            p.grad = g
        opt = cls(ps, adamw, **kw, **extra)
        return opt.step

    if compiled:
        return {
            "torch AdamW fused (no ZeRO)": lambda: torch_step(
                adamw, params, grads, fused=True, **kw
            ),
            "torch ZeRO, bucket view + fused": lambda: zero(
                TorchZero, parameters_as_bucket_view=True, fused=True
            ),
            "ours default": lambda: zero(ZeroRedundancyOptimizer),
            "ours default, compile=True": lambda: zero(ZeroRedundancyOptimizer, compile=True),
        }
    return {
        "torch AdamW foreach (no ZeRO)": lambda: torch_step(
            adamw, params, grads, foreach=True, **kw
        ),
        "torch AdamW fused (no ZeRO)": lambda: torch_step(adamw, params, grads, fused=True, **kw),
        "torch ZeRO default": lambda: zero(TorchZero),
        "torch ZeRO, bucket view + fused": lambda: zero(
            TorchZero, parameters_as_bucket_view=True, fused=True
        ),
        "ours default (sorted_greedy)": lambda: zero(ZeroRedundancyOptimizer),
        "ours bucket view": lambda: zero(ZeroRedundancyOptimizer, parameters_as_bucket_view=True),
        "ours flat": lambda: zero(ZeroRedundancyOptimizer, partition="flat"),
        "ours flat, bucket view": lambda: zero(
            ZeroRedundancyOptimizer, partition="flat", parameters_as_bucket_view=True
        ),
    }


def _main_step_builders(
    params: list[torch.Tensor], grads: list[torch.Tensor]
) -> dict[str, Callable[[], Step]]:
    """bf16 parameters updated through fp32 main copies: ours (main_params_dtype) against the
    same by hand with torch's fused AdamW on fp32 masters (gradients upcast, parameters
    rounded back), and torch's ZeRO keeping bf16 state."""
    kw: dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.01}
    adamw = torch.optim.AdamW

    def by_hand() -> Step:
        low = [p.clone() for p in params]
        masters = [nn.Parameter(p.float()) for p in params]
        for m in masters:
            m.grad = torch.empty_like(m)
        opt = adamw(masters, fused=True, **kw)

        def step() -> None:
            torch._foreach_copy_([m.grad for m in masters], grads)  # type: ignore[misc]
            opt.step()
            torch._foreach_copy_(low, masters)

        return step

    def zero(cls: type, **extra: Any) -> Step:
        ps = [nn.Parameter(p.clone()) for p in params]
        for p, g in zip(ps, grads):
            p.grad = g
        return cls(ps, adamw, **kw, **extra).step  # type: ignore[no-any-return]

    return {
        "torch fused AdamW on fp32 masters, by hand (no ZeRO)": by_hand,
        "torch ZeRO, bucket view + fused (bf16 state)": lambda: zero(
            TorchZero, parameters_as_bucket_view=True, fused=True
        ),
        "ours main_params_dtype=float32": lambda: zero(
            ZeroRedundancyOptimizer, main_params_dtype=torch.float32
        ),
        "ours main_params_dtype=float32, flat": lambda: zero(
            ZeroRedundancyOptimizer, main_params_dtype=torch.float32, partition="flat"
        ),
    }


def _timings_worker(rank: int, world_size: int, env: Env, compiled: bool) -> bool:
    """Kernels in fp32 and bf16, then whole steps (eager); or, ``compiled``, the compiled
    variants (fp32: the graphs take float32/float64 only) with torch's references measured
    again in the same process, most wanted first, each started only within half the budget."""
    run = "compile" if compiled else "eager"
    _redirect(env, run, rank)
    if "crash" in env["fault"] and not compiled:
        os._exit(3)
    if "hang" in env["fault"] and compiled:
        time.sleep(3600)  # as a compile that runs out of time
    dev = _device(env)
    t_start = time.monotonic()
    if compiled:
        plan = [
            ("AdamW", torch.float32),
            ("step()", torch.float32),
            ("SGD momentum", torch.float32),
        ]
    else:
        plan = [
            (k, d)
            for d in (torch.float32, torch.bfloat16)
            for k in ("AdamW", "Adam", "SGD momentum")
        ]
        plan.append(("step()", torch.float32))
        if "main_params_dtype" in inspect.signature(ZeroRedundancyOptimizer.__init__).parameters:
            plan.append(("step() main", torch.bfloat16))
    tensors: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for kernel, dtype in plan:
        dname = str(dtype).removeprefix("torch.")
        group = (
            f"step() AdamW {dname}, 1 rank"
            if kernel == "step()"
            else "step() AdamW bfloat16 + fp32 main, 1 rank"
            if kernel == "step() main"
            else f"{kernel} {dname}"
        )
        if compiled and time.monotonic() - t_start > env["compile_budget_s"] / 2:
            detail = f"not started: {time.monotonic() - t_start:.0f} s of the {env['compile_budget_s']:.0f} s budget spent"
            _emit(env, _timing_row(run, group, "compile=True", status="SKIP", detail=detail))
            continue
        if dtype not in tensors:
            tensors.clear()  # one dtype's tensors at a time
            tensors[dtype] = (
                _tensors(env, dtype, 0.02, seed=0),
                _tensors(env, dtype, 1e-3, seed=1),
            )
        params, grads = tensors[dtype]
        if kernel == "step()":
            builders = _whole_step_builders(params, grads, compiled)
        elif kernel == "step() main":
            builders = _main_step_builders(params, grads)
        else:
            builders = _kernel_variants(kernel, params, grads, compiled)
        _time_group(env, run, group, builders, dev)
    return True


# ============================================================================ the driver


class Tee:
    """This process's stdout, also written to a file."""

    def __init__(self, stream: Any, path: Path) -> None:
        self.stream, self.file = stream, open(path, "w")

    def write(self, s: str) -> int:
        self.file.write(s)
        self.file.flush()
        return self.stream.write(s)

    def flush(self) -> None:
        self.stream.flush()
        self.file.flush()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _say(status: str, name: str, detail: str) -> None:
    print(f"{status} {name}: {detail}", flush=True)


def _environment(args: argparse.Namespace) -> list[str]:
    """What ran: versions, the device, the command (printed first, kept for the summary)."""
    lines = [
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"zero_functional {_package_version()}, {os.cpu_count()} CPUs, {platform.platform()}",
    ]
    if args.cpu:
        lines.append("device: CPU (--cpu: gloo, CPU tensors, small sizes)")
    else:
        props = torch.cuda.get_device_properties(0)
        try:
            nccl_module = importlib.import_module("torch.cuda.nccl")
            nccl = ".".join(map(str, nccl_module.version()))
        except Exception as e:
            nccl = f"? ({type(e).__name__})"
        lines.append(
            f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}, "
            f"{torch.cuda.device_count()} GPU(s); CUDA {torch.version.cuda}, NCCL {nccl} "
            f"(available to torch.distributed: {dist.is_nccl_available()}), "
            f"driver {_nvidia_driver()}"
        )
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "not installed"
    compile_params = inspect.signature(torch.compile).parameters
    lines.append(
        f"triton {triton}; C compiler {shutil.which('cc') or shutil.which('gcc') or 'none'}; "
        f"torch.compile takes isolate_recompiles (zero_functional's compiled kernels pass it): "
        f"{'isolate_recompiles' in compile_params}; ZeroRedundancyOptimizer takes "
        f"main_params_dtype: "
        f"{'main_params_dtype' in inspect.signature(ZeroRedundancyOptimizer.__init__).parameters}"
    )
    lines.append(f"git: {_git()}")
    return lines


def _package_version() -> str:
    import zero_functional

    return str(getattr(zero_functional, "__version__", "?"))


def _nvidia_driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
        )
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "?"
    except Exception:
        return "?"


def _git() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "log", "-1", "--format=%h %s"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        head = out.stdout.strip()
        return (head + (" (+ uncommitted changes)" if dirty.stdout.strip() else "")) or "unknown"
    except Exception:
        return "unknown (no git here)"


class Driver:
    """Runs the parts within the budget, prints every row, writes the summary."""

    def __init__(self, args: argparse.Namespace, env: Env, out: Path, header: list[str]) -> None:
        self.args, self.env, self.out, self.header = args, env, out, header
        self.deadline = time.monotonic() + args.budget_s
        self.rows: list[Row] = []
        self.read = 0  # lines of the rows file already taken

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def part(
        self,
        tag: str,
        title: str,
        fn: Callable[..., Any],
        world: int,
        *args: Any,
        max_s: float,
        backend: str | None = None,
    ) -> tuple[bool, str]:
        """Run ``fn`` on ``world`` ranks for at most ``max_s`` (and the budget left)."""
        limit = min(max_s, self.left() - 5)
        if limit < 20:
            self.add(
                {
                    "part": tag,
                    "name": title,
                    "world": world,
                    "status": "SKIP",
                    "detail": f"the run's budget ({self.args.budget_s:.0f} s) is spent",
                }
            )
            return False, "budget"
        backend = backend or self.env["backend"]
        print(f"\n== {title}: {world} rank(s), {backend}, at most {limit:.0f} s", flush=True)
        t0 = time.monotonic()
        ok, why = True, ""
        try:
            run_ranks(
                fn,
                world,
                self.env,
                *args,
                timeout_s=limit,
                pg_timeout_s=min(60.0, limit),
                backend=backend,
                num_threads=1 if self.args.cpu else None,
            )
        except LaunchError as e:
            ok, why = False, str(e)
        except Exception as e:  # the launcher itself failed
            ok, why = False, f"{type(e).__name__}: {e}"
        self._collect()
        took = time.monotonic() - t0
        if not ok:
            first = why.strip().splitlines()[0] if why.strip() else "?"
            timed_out = took >= limit - 1 or "gave no result within" in why
            print(f"-- the ranks failed after {took:.0f} s: {first}", flush=True)
            for line in why.strip().splitlines()[1:14]:
                print(f"   {line}", flush=True)
            self._log_tail(tag)
            if tag != "nccl2":  # the probe's failure is its finding, reported by the caller
                status = "SKIP" if tag == "compile" and timed_out else "FAIL"
                detail = (
                    f"stopped at the {limit:.0f} s limit (compiling took too long)"
                    if status == "SKIP"
                    else f"the ranks failed after {took:.0f} s: {first[:300]}"
                )
                self.add(
                    {
                        "part": tag,
                        "name": f"{title} (ranks)",
                        "world": world,
                        "status": status,
                        "detail": detail,
                    }
                )
        else:
            print(f"-- {title}: {took:.0f} s", flush=True)
        self.write()
        return ok, why

    def _log_tail(self, tag: str) -> None:
        for path in sorted(Path(self.env["tmp"]).glob(f"{tag}*.log")):
            lines = path.read_text(errors="replace").splitlines()
            print(f"   -- last lines of {path.name}:", flush=True)
            for line in lines[-12:]:
                print(f"   | {line[:200]}", flush=True)

    def _collect(self) -> None:
        path = Path(self.env["rows"])
        if not path.exists():
            return
        lines = path.read_text().splitlines()
        fresh, self.read = lines[self.read :], len(lines)
        merged: dict[tuple[Any, ...], Row] = {}
        for line in fresh:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            key = (
                row.get("part"),
                row.get("run"),
                row.get("group"),
                row.get("name"),
                row.get("world"),
            )
            seen = merged.get(key)
            order = (RANK_ORDER[row["status"]], row.get("rank", 0))
            if seen is None or order < (RANK_ORDER[seen["status"]], seen.get("rank", 0)):
                merged[key] = row  # the worst rank's row; on a tie, the lowest rank's
        for row in merged.values():
            self.add(row)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        name = self._label(row)
        if "ms" in row:
            detail = f"{row['ms']:.3f} ms"
        else:
            detail = row.get("detail", "")
            if row.get("rank", 0) and row["status"] != "PASS":
                detail += f" (rank {row['rank']})"
        _say(row["status"], name, detail)
        if row["status"] == "FAIL" and row.get("traceback"):
            for line in row["traceback"].strip().splitlines()[-8:]:
                print(f"   | {line[:200]}", flush=True)

    @staticmethod
    def _label(row: Row) -> str:
        if row.get("group"):
            return f"{row['part']}/{row['group']}/{row['name']}"
        return f"{row['part']}/w{row.get('world', 1)}/{row['name']}"

    # ------------------------------------------------------------------ the summary

    def markdown(self) -> str:
        env = self.env
        counts = {s: sum(r["status"] == s for r in self.rows) for s in RANK_ORDER}
        cmd = f"PYTHONPATH=src python3 {shlex.join(['benchmarks/gpu_check.py', *sys.argv[1:]])}"
        checks = [r for r in self.rows if not r.get("group")]
        worlds = sorted({int(r.get("world", 1)) for r in checks}) or [1]
        by_name: dict[tuple[str, str], dict[int, Row]] = {}
        for r in checks:
            by_name.setdefault((r["part"], r["name"]), {})[int(r.get("world", 1))] = r
        cols = " | ".join(f"{w} rank{'s' if w > 1 else ''}" for w in worlds)
        out = [
            f"### GPU check ({'CPU stand-in: gloo' if env['cpu'] else 'CUDA + NCCL'}): "
            f"{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP",
            "",
            f"`{cmd}`",
            "",
            *[f"- {line}" for line in self.header],
            "",
            f"| check | {cols} | detail |",
            "|---|" + "---|" * len(worlds) + "---|",
        ]
        for (part, name), per_world in by_name.items():
            cells = " | ".join(per_world[w]["status"] if w in per_world else "" for w in worlds)
            first = per_world[min(per_world)]
            detail = str(first.get("detail", ""))
            for w, r in sorted(per_world.items()):
                if w != min(per_world) and r["status"] != first["status"]:
                    detail += f"; at {w} ranks: {r.get('detail', '')}"
            label = name if part == "modes" else f"{part}: {name}"
            out.append(f"| {label} | {cells} | {_cell(detail)} |")
        out += self._timing_tables()
        return "\n".join(out) + "\n"

    def _timing_tables(self) -> list[str]:
        timed = [r for r in self.rows if r.get("group")]
        if not timed:
            return []
        layers, width, vocab, ctx = self.env["gpt2"]
        shapes = gpt2_shapes(layers, width, vocab_size=vocab, n_positions=ctx)
        out = [
            "",
            f"Timings (ms per step): {len(shapes)} tensors, {total_numel(shapes):,} "
            f"parameters (GPT-2 {'small' if width == 768 else 'shapes, scaled down'}), median "
            f"of {self.env['rounds']} interleaved rounds after {self.env['warmup']} warm-up, "
            f"{'wall clock' if self.env['cpu'] else 'CUDA events'}; x = over torch's best "
            "variant of the same table row group, measured in the same process (below 1 is "
            "faster).",
        ]
        groups: dict[tuple[str, str], list[Row]] = {}
        for r in timed:
            groups.setdefault((r.get("run", "eager"), r["group"]), []).append(r)
        best = {
            key: min(
                (r["ms"] for r in rows if "ms" in r and r["name"].startswith("torch")), default=None
            )
            for key, rows in groups.items()
        }

        def cell(r: Row | None, key: tuple[str, str]) -> str:
            if r is None:
                return " | "
            if "ms" not in r:
                return f"{r['status']}: {_cell(str(r.get('detail', '')))[:160]} | "
            b = best[key]
            return f"{r['ms']:.3f} | " + (f"{r['ms'] / b:.2f}x" if b else "n/a")

        kernels = [k for k in groups if k[0] == "eager" and not k[1].startswith("step()")]
        if kernels:
            dtypes = list(dict.fromkeys(g.rsplit(" ", 1)[1] for _, g in kernels))
            head = " | ".join(f"{d} ms | x torch best" for d in dtypes)
            out += ["", f"| kernel | variant | {head} |", "|---|---|" + "---|---|" * len(dtypes)]
            for opt in dict.fromkeys(g.rsplit(" ", 1)[0] for _, g in kernels):
                names = dict.fromkeys(
                    r["name"] for d in dtypes for r in groups.get(("eager", f"{opt} {d}"), [])
                )
                for name in names:
                    cells = []
                    for d in dtypes:
                        key = ("eager", f"{opt} {d}")
                        row = next((r for r in groups.get(key, []) if r["name"] == name), None)
                        cells.append(cell(row, key))
                    out.append(f"| {opt} | {name} | {' | '.join(cells)} |")
        for key, rows in groups.items():
            if key in kernels:
                continue
            run, group = key
            title = group if run == "eager" else f"{group}, compile run"
            out += ["", f"| {title} | ms | x torch best |", "|---|---|---|"]
            for r in rows:
                if "first_s" in r:
                    out.append(f"| {r['name']} | {r['first_s']:.1f} s | |")
                else:
                    out.append(f"| {r['name']} | {cell(r, key)} |")
        return out

    def recap(self) -> str:
        """The last lines of the output: counts and every check that did not pass."""
        counts = {s: sum(r["status"] == s for r in self.rows) for s in RANK_ORDER}
        lines = [
            f"RESULT: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP "
            f"({'CPU/gloo' if self.env['cpu'] else 'CUDA/NCCL'})"
        ]
        for r in self.rows:
            if r["status"] != "PASS":
                lines.append(f"  {r['status']} {self._label(r)}: {str(r.get('detail', ''))[:240]}")
        return "\n".join(lines)

    def write(self) -> None:
        (self.out / "gpu_check.md").write_text(self.markdown())
        (self.out / "gpu_check.json").write_text(json.dumps(self.rows, indent=1, default=str))


def _settings(args: argparse.Namespace, tmp: str) -> Env:
    cpu, quick = args.cpu, args.quick
    if cpu:
        gpt2 = (1, 32, 512, 64) if quick else (2, 64, 2048, 128)
    else:
        gpt2 = (12, 768, 50257, 1024)  # GPT-2 small: 148 tensors, 124.4M parameters
    return {
        "cpu": cpu,
        "backend": "gloo" if cpu else "nccl",
        "steps": 6 if quick else 10,
        "width": 32 if cpu else 64,
        "coll_numel": 100_003 if cpu else 1 << 24,
        "gpt2": gpt2,
        "rounds": (5 if quick else 10) if cpu else (10 if quick else 30),
        "warmup": 2 if cpu else 3,
        "compile_budget_s": args.compile_budget_s,
        "tmp": tmp,
        "rows": os.path.join(tmp, "rows.jsonl"),
        "fault": list(args.fault),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", default="gpu_check_out", help="directory for the summary and logs")
    ap.add_argument("--cpu", action="store_true", help="gloo and CPU tensors (no GPU needed)")
    ap.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    ap.add_argument("--budget-s", type=float, default=300.0, help="the whole run, seconds")
    ap.add_argument("--compile-budget-s", type=float, default=120.0, help="the compile part")
    ap.add_argument("--parts", nargs="*", choices=PARTS, default=list(PARTS))
    ap.add_argument(
        "--fault",
        nargs="*",
        choices=("case", "crash", "hang"),
        default=[],
        help="to test this script: a check that raises (case), the timings rank dying (crash), "
        "the 2-rank probe and the compile rank hanging (hang)",
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.stdout = Tee(sys.stdout, out / "gpu_check.log")  # type: ignore[assignment]
    t0 = time.monotonic()
    print(
        f"$ PYTHONPATH={os.environ.get('PYTHONPATH', '')} {shlex.join([sys.executable, *sys.argv])}"
    )
    print(f"started {datetime.datetime.now():%Y-%m-%d %H:%M:%S}, cwd {os.getcwd()}")
    if not args.cpu and not torch.cuda.is_available():
        _say("FAIL", "environment", "no CUDA device visible to torch; pass --cpu to test on CPU")
        return 1
    header = _environment(args)
    for line in header:
        print(line)
    tmp = tempfile.mkdtemp(prefix="gpu_check.")
    env = _settings(args, tmp)
    driver = Driver(args, env, out, header)
    try:
        _run(driver, args)
    finally:
        logs = sorted(Path(tmp).glob("*.log"))
        with open(out / "gpu_check_ranks.log", "w") as f:
            for path in logs:
                f.write(f"\n######## {path.name}\n{path.read_text(errors='replace')}")
        shutil.rmtree(tmp, ignore_errors=True)
        driver.write()
    print("\n" + driver.markdown())
    print(driver.recap())
    fails = sum(r["status"] == "FAIL" for r in driver.rows)
    print(
        f"finished in {time.monotonic() - t0:.0f} s; {fails} FAIL; summary in {out / 'gpu_check.md'}"
    )
    return 1 if fails else 0


def _run(driver: Driver, args: argparse.Namespace) -> None:
    env = driver.env
    world2 = False
    if "modes" in args.parts:
        driver.part("modes", "modes", _modes_worker, 1, max_s=120)
    if "nccl2" in args.parts:
        ok, why = driver.part(
            "nccl2", f"{env['backend']}: probe with 2 ranks", _probe_worker, 2, max_s=45
        )
        gpus = 0 if env["cpu"] else torch.cuda.device_count()
        where = "the CPU" if env["cpu"] else ("one GPU" if gpus == 1 else f"{min(gpus, 2)} GPUs")
        name = f"{env['backend']}: 2 ranks on {where}"
        if ok:
            driver.add(
                {
                    "part": "nccl2",
                    "name": name,
                    "world": 2,
                    "status": "PASS",
                    "detail": f"the backend took 2 ranks on {where}; modes run at 2 ranks",
                }
            )
            world2 = "modes" in args.parts
        elif why != "budget":
            lines = [ln.strip() for ln in why.splitlines() if ln.strip()]
            hint = next((ln for ln in lines if "uplicate GPU" in ln), lines[0] if lines else "?")
            driver.add(
                {
                    "part": "nccl2",
                    "name": name,
                    "world": 2,
                    "status": "SKIP",
                    "detail": f"refused (or hung), modes run at 1 rank only: {hint[:300]}",
                }
            )
    if "timings" in args.parts:
        driver.part("timings", "timings", _timings_worker, 1, False, max_s=120)
    if world2:
        driver.part("modes", "modes at 2 ranks", _modes_worker, 2, max_s=120)
    if "compile" in args.parts:
        driver.part(
            "compile",
            "compiled kernels",
            _timings_worker,
            1,
            True,
            max_s=args.compile_budget_s + 30,
        )


if __name__ == "__main__":
    sys.exit(main())
