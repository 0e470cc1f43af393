"""Compressed collectives (issue 41): bytes per iteration and iteration time with 8 or 16 bits on the wire.

Whole iterations (forward, backward, step) of the 8 x Linear(512, 512) MLP with Adam (issue 33's
model), every variant round by round inside the same gloo ranks, at each world size:

* ``ddp + fused adam``: plain DDP (torch's best configuration here; every ratio's baseline);
* ``ddp + fp16_compress_hook``: DDP's all-reduce in 16 bits (torch's ``bf16_compress_hook``
  refuses the CPU), every partial sum rounded again;
* ``ours flat, uncompressed``: flat partition, ``reduce_scatter_hook``, step after backward (DDP's
  bytes: the byte baseline), and ``..., interleaved``: the same in overlap mode;
* ``ours <bf16|int8|fp8> both ways, <mode>``: gradients' contributions cross encoded
  (``wire_dtype=``) and the parameter all-gather carries each piece's change encoded
  (``ZeroRedundancyOptimizer(gather_dtype=...)``), in each mode: ``after backward``
  (``reduce_scatter_hook``), ``hook_with_zero_step`` and ``interleaved``
  (``hook_with_zero_step_interleaved``; both with ``overlap_with_ddp=True`` and
  ``allreduce_hook``);
* ``fsdp2, reshard_after_forward=False|True``: ``fully_shard`` per Linear and at the root over
  ``init_device_mesh("cpu", (N,))``, fused Adam;
* ``deepspeed zero-1|2``: DeepSpeed (``DS_ACCELERATOR=cpu``, gloo), fp32, the client optimizer
  ``torch.optim.Adam(fused=True)``; rows say "not installed" without it (``pip install
  deepspeed==0.19.8``; its first use builds a C++ op, a few minutes);
* ``ddp + powerSGD_hook``: rank 1, from its second iteration, in ranks of its own beside a DDP of
  its own (gloo in torch 2.13 fails at its first compressed step: the row then says how).

Bytes per rank and iteration are counted two ways. From the collectives that ran
(``_common.ByteCounter``: ring algorithms' bytes; DDP's built-in all-reduce is counted through
``allreduce_hook`` in a DDP of its own); and, where the ranks run in a private network namespace
(``--link RATE``, or ``--kernel-bytes``: the same ``unshare -rn`` re-run with an unshaped
loopback), by the kernel: the loopback's transmitted bytes (``/proc/net/dev``) around each
variant's calls in the timed rounds, less what the barriers around them send alone, over the
iterations and **divided by the number of ranks** (every rank sends on that one ``lo``; TCP/IP
and gloo's headers included). Ratios of bytes are against ``ours flat, uncompressed`` (issue 41:
int8 both ways <= 0.30x, bf16 <= 0.55x); ratios of time against DDP + fused Adam and DDP +
``fp16_compress_hook`` (issue 41 on a 2 Gbit/s link at 4 ranks: int8 <= 0.55x DDP and <= 0.80x
the fp16 hook, bf16 <= 0.70x DDP). With ``--link`` each row also shows its byte floor (the
kernel's bytes of every rank, together, over the rate).

    python benchmarks/bench_compressed.py [--world-sizes 2 4] [--rounds 10]
        [--link 2gbit | --kernel-bytes] [--only SUBSTR ...] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    allreduce_hook,
    fp16_compress_hook,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import ByteCounter, add_link_argument, median_ms, mlp, run_ranks
from zero_functional.app.launch import LaunchError
from zero_functional.app.link import LINK_ENV, byte_floor_ms, run_shaped
from zero_functional.hooks import (
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    reduce_scatter_hook,
)
from zero_functional.optimizer import ZeroRedundancyOptimizer

PRIVATE_ENV = "ZERO_FUNCTIONAL_PRIVATE_LO"  # set inside --kernel-bytes' namespace: no second re-run
LR = 1e-4
BATCH = 32

DDP_NAME = "ddp + fused adam"
DDP_FP16 = "ddp + fp16_compress_hook"
OURS = "ours flat, uncompressed"
OURS_OVERLAP = "ours flat, uncompressed, interleaved"
FORMATS = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
MODES = ("after backward", "hook_with_zero_step", "interleaved")
FSDP2 = [f"fsdp2, reshard_after_forward={r}" for r in (False, True)]
DEEPSPEED = [f"deepspeed zero-{s}" for s in (1, 2)]
POWERSGD = "ddp + powerSGD_hook"
POWERSGD_S = 180  # it may hang on gloo instead of failing: its ranks get this long
BARRIERS = "(the barriers alone)"  # the kernel bytes every call's barriers send, subtracted
TARGETS = {"int8": 0.30, "bf16": 0.55}  # issue 41: bytes x ours uncompressed


def compressed(fmt: str, mode: str) -> str:
    return f"ours {fmt} both ways, {mode}"


OURS_VARIANTS: dict[str, tuple[torch.dtype | None, str]] = {
    OURS: (None, "after backward"),
    OURS_OVERLAP: (None, "interleaved"),
    **{compressed(f, m): (dtype, m) for f, dtype in FORMATS.items() for m in MODES},
}
"""Ours: name -> (wire and gather dtype, mode)."""


def variants() -> list[str]:
    """Every variant of the shared rounds, baselines first (PowerSGD runs apart)."""
    return [DDP_NAME, DDP_FP16, *OURS_VARIANTS, *FSDP2, *DEEPSPEED]


def _loss(module: nn.Module, x: Tensor) -> Tensor:
    out: Tensor = module(x)
    return out.square().mean()


def _iteration(module: nn.Module, opt: Any, steps: bool) -> Callable[[Tensor], None]:
    def one(x: Tensor) -> None:
        opt.zero_grad()
        _loss(module, x).backward()
        if steps:  # overlap mode steps inside backward
            opt.step()

    return one


def _build(
    name: str, numel: int, width: int, mesh: Any, counting: bool
) -> tuple[nn.Module, Callable[[Tensor], None], Callable[[], None]]:
    """The variant ``name``: its model (for the parameters), one iteration, and what finishes
    its parameter all-gather (overlap mode may leave the last one in flight)."""
    model = mlp(numel, width=width)
    done: Callable[[], None] = lambda: None  # noqa: E731
    if name.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        reshard = name.endswith("True")
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = torch.optim.Adam(model.parameters(), lr=LR, fused=True)
        return model, _iteration(model, opt, steps=True), done
    if name.startswith("deepspeed"):
        return _deepspeed(int(name[-1]), model)
    ddp = DDP(model)
    if name in (DDP_NAME, DDP_FP16, POWERSGD):
        if name == DDP_FP16:
            ddp.register_comm_hook(None, fp16_compress_hook)
        elif name == POWERSGD:
            state = powersgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
            ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        elif counting:  # DDP's built-in all-reduce runs in C++: the Python hook is the same
            ddp.register_comm_hook(None, allreduce_hook)
        opt = torch.optim.Adam(ddp.parameters(), lr=LR, fused=True)
        return ddp.module, _iteration(ddp, opt, steps=True), done
    dtype, mode = OURS_VARIANTS[name]
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(),
        torch.optim.Adam,
        overlap_with_ddp=mode != "after backward",
        partition="flat",
        gather_dtype=dtype,
        lr=LR,
    )
    if mode == "after backward":
        ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero, wire_dtype=dtype))
    else:
        wrap = (
            hook_with_zero_step
            if mode == "hook_with_zero_step"
            else hook_with_zero_step_interleaved
        )
        ddp.register_comm_hook(None, wrap(allreduce_hook, ddp, zero, wire_dtype=dtype))
    return (
        ddp.module,
        _iteration(ddp, zero, steps=mode == "after backward"),
        zero.finish_param_sync,
    )


def _deepspeed(
    stage: int, model: nn.Module
) -> tuple[nn.Module, Callable[[Tensor], None], Callable[[], None]]:
    import logging

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for key, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", world_size)):
        os.environ.setdefault(key, str(value))  # DeepSpeed reads them (one machine)
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    # DeepSpeed keeps torch's all-gather and reduce-scatter from before any counter wraps them:
    # looked up at each call instead (the same functions), so that ByteCounter sees them
    backend = deepspeed.comm.comm.cdb
    backend.all_gather_function = lambda *a, **k: dist.all_gather_into_tensor(*a, **k)
    backend.reduce_scatter_function = lambda *a, **k: dist.reduce_scatter_tensor(*a, **k)
    opt = torch.optim.Adam(model.parameters(), lr=LR, fused=True)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "train_batch_size": BATCH * world_size,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def one(x: Tensor) -> None:
        loss = _loss(engine, x)
        engine.backward(loss)
        engine.step()  # zeroes the gradients too

    return engine.module, one, lambda: None


def _lo_tx() -> int:
    """The loopback's transmitted bytes (``/proc/net/dev``: this network namespace's)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])
    raise RuntimeError("no lo in /proc/net/dev")


def _worker(
    rank: int,
    world_size: int,
    names: list[str],
    numel: int,
    width: int,
    rounds: int,
    kernel: bool,
) -> dict[str, Any]:
    torch.set_num_threads(max(1, 2 // world_size))
    # torch's own, raised where FSDP2 and DeepSpeed call it: nothing to act on here
    warnings.filterwarnings("ignore", ".*all_gather_into_tensor. is deprecated")
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(rank))
    mesh = None
    if any(n.startswith("fsdp2") for n in names):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size,))
    built = {name: _build(name, numel, width, mesh, counting=False) for name in names}

    def call(name: str) -> None:
        if name == BARRIERS:
            return
        _, one, done = built[name]
        one(x)
        one(x)
        done()

    calls = [*names, BARRIERS] if kernel else names
    times: dict[str, list[float]] = {name: [] for name in calls}
    tx = dict.fromkeys(calls, 0)
    for r in range(rounds + 2):
        for name in calls:
            dist.barrier()
            before = _lo_tx() if kernel else 0
            dist.barrier()  # nobody sends this call's bytes before every rank has read
            t0 = time.perf_counter()
            call(name)
            elapsed = time.perf_counter() - t0
            if kernel:
                dist.barrier()  # every rank's bytes sent
            if r >= 2:  # two warm-up rounds for every variant alike
                times[name].append(elapsed)
                if kernel:
                    tx[name] += _lo_tx() - before
    diff, apart = {}, []
    base = [p.detach() for p in built[DDP_NAME][0].parameters()]
    for name in names:
        mine = [_full(p) for p in built[name][0].parameters()]
        diff[name] = max((a - b).abs().max().item() for a, b in zip(mine, base))
        flat = torch.cat([p.reshape(-1) for p in mine])
        first = flat.clone()
        dist.broadcast(first, 0)
        if not torch.equal(flat, first):  # every variant keeps the same parameters everywhere
            apart.append(name)
    built.clear()  # the counting below builds each variant again
    counter = ByteCounter()
    sent: dict[str, float] = {}
    for name in names:
        _, one, done = _build(name, numel, width, mesh, counting=True)
        for _ in range(2):  # past DDP's first-iteration buckets and overlap mode's adoption
            one(x)
        done()
        counter.reset()
        with counter.counting():
            one(x)
            done()
        sent[name] = counter.sent
    iterations = 2 * rounds
    kernel_sent = {}
    if kernel:  # every rank's bytes on the one lo: per rank and iteration
        per_call = tx[BARRIERS]
        kernel_sent = {n: (tx[n] - per_call) / iterations / world_size for n in names}
    ms = {name: median_ms(times[name]) / 2 for name in names}
    return {"ms": ms, "sent": sent, "kernel": kernel_sent, "diff": diff, "apart": apart}


def _full(p: Tensor) -> Tensor:
    """A parameter's whole value (FSDP2's are sharded DTensors: gathered, collectively)."""
    full = getattr(p, "full_tensor", None)
    return (full() if full is not None else p).detach()


def _powersgd_worker(
    rank: int, world_size: int, numel: int, width: int, rounds: int, log: str
) -> dict[str, Any]:
    """DDP + ``powerSGD_hook`` beside a DDP of its own, same rounds (ranks of their own: a gloo
    failure there must not end the shared rounds). gloo's checks end the process from C++: the
    rank's stderr goes to ``log``/rank<N>.txt, each iteration numbered there, for the report."""
    torch.set_num_threads(max(1, 2 // world_size))
    os.dup2(os.open(f"{log}/rank{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(rank))
    names = [DDP_NAME, POWERSGD]
    built = {name: _build(name, numel, width, None, counting=False) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    iteration = 0
    for r in range(rounds + 2):
        for name in names:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(2):
                if name == POWERSGD:
                    iteration += 1
                    os.write(2, f"{POWERSGD}: iteration {iteration}\n".encode())
                built[name][1](x)
            if r >= 2:
                times[name].append(time.perf_counter() - t0)
    counter = ByteCounter()
    with counter.counting():
        built[POWERSGD][1](x)
    return {"ms": {n: median_ms(times[n]) / 2 for n in names}, "sent": counter.sent}


def _failure(error: LaunchError, log: Path) -> str:
    """What failed: gloo's check and the iteration it stopped, from the ranks' stderr (its
    C++ check aborts the process), else the launcher's first line."""
    for path in sorted(log.glob("rank*.txt")):
        iteration = ""
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith(f"{POWERSGD}: iteration"):
                iteration = line.rsplit(" ", 1)[-1]
            elif "enforce fail" in line:
                check = line.split("] ", 1)[-1].split(" Is there")[0]
                where = f"iteration {iteration}, {path.stem}; compressed from iteration 3"
                return f"failed ({where}): gloo: {check}"
    reached = [
        int(line.rsplit(" ", 1)[-1])
        for path in log.glob("rank*.txt")
        for line in path.read_text(errors="replace").splitlines()
        if line.startswith(f"{POWERSGD}: iteration")
    ]
    lines = str(error).strip().splitlines()
    where = f" (iteration {max(reached)}; compressed from iteration 3)" if reached else ""
    return f"failed{where}: {lines[0] if lines else 'no message'}"


def _run_private(kernel: bool) -> bool:
    """With ``--kernel-bytes``, re-run this program in a private network namespace (``unshare
    -rn``, loopback up, unshaped) and exit with its status; return whether the ranks run on a
    loopback of their own (there, or on ``--link``'s)."""
    if os.environ.get(LINK_ENV) or os.environ.get(PRIVATE_ENV):
        return True
    if not kernel:
        return False
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        print("--kernel-bytes: unshare or ip not found", file=sys.stderr)
        raise SystemExit(2)
    argv = [sys.executable, *sys.argv]
    command = ["unshare", "-rn", "sh", "-c", f"ip link set lo up && exec {shlex.join(argv)}"]
    env = {**os.environ, PRIVATE_ENV: "1"}
    raise SystemExit(subprocess.run(command, env=env, check=False).returncode)


def _report(
    ws: int,
    names: list[str],
    results: list[dict[str, Any]],
    missing: dict[str, str],
    args: argparse.Namespace,
    label: str,
) -> list[dict[str, Any]]:
    """Print one world size's table and the issue's targets; its rows for ``--json``."""
    kernel = bool(results[0]["kernel"])
    ms = {n: max(r["ms"][n] for r in results) for n in names}  # the slowest rank
    sent = {n: max(r["sent"][n] for r in results) for n in names}
    kern = {n: results[0]["kernel"][n] for n in names} if kernel else {}  # one lo: any rank
    ddp, fp16 = ms[DDP_NAME], ms[DDP_FP16]
    print(f"\n== {label}, world size {ws}, median of {args.rounds} rounds (2 iterations each)")
    head = f"{'variant':<44}{'iter ms':>9}{'x ddp':>8}{'x fp16 hook':>13}"
    head += f"{'MB/rank counted':>17}{'x ours':>8}"
    if kernel:
        head += f"{'MB/rank kernel':>16}{'x ours':>8}"
    if args.link:
        head += f"{'floor ms':>10}{'x floor':>9}"
    print(head + f"{'max|dp| vs ddp':>16}")
    rows = []
    for n in names:
        line = f"{n:<44}{ms[n]:>9.1f}{ms[n] / ddp:>7.2f}x{ms[n] / fp16:>12.2f}x"
        line += f"{sent[n] / 1e6:>17.2f}{sent[n] / sent[OURS]:>7.2f}x"
        row: dict[str, Any] = {
            "benchmark": f"compressed ({label})",
            "world_size": ws,
            "variant": n,
            "ms": ms[n],
            "vs_torch_best": ms[n] / ddp,
            "vs_fp16_hook": ms[n] / fp16,
            "mb_sent": sent[n] / 1e6,
            "vs_ours_bytes": sent[n] / sent[OURS],
        }
        if kernel:
            line += f"{kern[n] / 1e6:>16.2f}{kern[n] / kern[OURS]:>7.2f}x"
            row.update(kernel_mb=kern[n] / 1e6, kernel_vs_ours=kern[n] / kern[OURS])
        if args.link:
            basis = kern[n] if kernel else sent[n]
            floor = byte_floor_ms(basis * ws, args.link)
            line += f"{floor:>10.1f}{ms[n] / floor:>8.2f}x"
            row.update(floor_ms=floor, vs_floor=ms[n] / floor)
        diff = max(r["diff"][n] for r in results)
        print(line + f"{diff:>16.1e}")
        rows.append(row)
    for n, why in missing.items():
        print(f"{n:<44}  {why}")
    print("issue 41's byte targets (x ours flat, uncompressed; counted / kernel):")
    for fmt, target in TARGETS.items():
        for mode in MODES:
            n = compressed(fmt, mode)
            if n not in ms:
                continue
            got = [sent[n] / sent[OURS]] + ([kern[n] / kern[OURS]] if kernel else [])
            shown = " / ".join(f"{g:.3f}x" for g in got)
            verdict = "met" if all(g <= target for g in got) else "NOT met"
            print(f"  {n:<42} {shown:>17}  <= {target:.2f}x: {verdict}")
    apart = sorted({n for r in results for n in r["apart"]})
    print(
        f"parameters bitwise equal on every rank: {'every variant' if not apart else 'NOT in'}",
        end="",
    )
    print(f" {', '.join(apart)}" if apart else "")
    if DDP_FP16 in ms and args.link:  # the issue asks them where bytes cost
        print("issue 41's time targets (x ddp + fused adam, x ddp + fp16_compress_hook):")
        for fmt, (vs_ddp, vs_fp16) in {"int8": (0.55, 0.80), "bf16": (0.70, None)}.items():
            for mode in MODES:
                n = compressed(fmt, mode)
                if n not in ms:
                    continue
                ok = ms[n] / ddp <= vs_ddp and (vs_fp16 is None or ms[n] / fp16 <= vs_fp16)
                want = f"<= {vs_ddp:.2f}x ddp" + (f", <= {vs_fp16:.2f}x fp16" if vs_fp16 else "")
                print(
                    f"  {n:<42} {ms[n] / ddp:.2f}x, {ms[n] / fp16:.2f}x  {want}: "
                    f"{'met' if ok else 'NOT met'}"
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", help="(2 4; --quick: 2)")
    ap.add_argument("--rounds", type=int, help="timed rounds of two iterations (10; --quick: 3)")
    ap.add_argument(
        "--numel", type=int, help="the MLP's size: numel // width**2 layers (8 x 512 x 512)"
    )
    ap.add_argument("--width", type=int, default=512, help="the MLP's layer width (512)")
    ap.add_argument(
        "--kernel-bytes",
        action="store_true",
        help="re-run in a private network namespace (unshare -rn), loopback unshaped, to count "
        "bytes by the kernel as well (--link does too)",
    )
    ap.add_argument(
        "--only",
        nargs="+",
        metavar="SUBSTR",
        help="only the variants whose name holds one of these (the baselines always)",
    )
    ap.add_argument("--quick", action="store_true", help="2 ranks, 3 rounds")
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    add_link_argument(ap)
    args = ap.parse_args()
    run_shaped(args.link)
    private = _run_private(args.kernel_bytes)
    args.world_sizes = args.world_sizes or ([2] if args.quick else [2, 4])
    args.rounds = args.rounds or (3 if args.quick else 10)
    args.numel = args.numel or 8 * args.width * args.width
    command = shlex.join(["python", "benchmarks/bench_compressed.py", *sys.argv[1:]])
    print(f"$ PYTHONPATH={os.environ.get('PYTHONPATH', '')} {command}")
    print(f"torch {torch.__version__}, gloo, {os.cpu_count()} CPU cores", end="")
    print(", kernel bytes: the private loopback's tx / ranks" if private else "")
    names = variants()
    if args.only:
        keep = [DDP_NAME, DDP_FP16, OURS]
        names = [n for n in names if n in keep or any(s in n for s in args.only)]
    missing = {}
    if importlib.util.find_spec("deepspeed") is None:
        missing = {n: "not installed (pip install deepspeed==0.19.8)" for n in DEEPSPEED}
    names = [n for n in names if n not in missing]
    layers = args.numel // args.width**2
    label = f"{layers} x Linear({args.width}, {args.width}) MLP + Adam"
    if args.link:
        label += f" on {args.link}"
    rows = []
    for ws in args.world_sizes:
        work = (names, args.numel, args.width, args.rounds, private)
        results = run_ranks(_worker, ws, *work, timeout_s=3600)
        why = dict(missing)
        if not args.only or any(s in POWERSGD for s in args.only):
            with tempfile.TemporaryDirectory() as log:
                try:
                    work = (args.numel, args.width, args.rounds, log)
                    got = run_ranks(_powersgd_worker, ws, *work, timeout_s=POWERSGD_S)
                except LaunchError as e:
                    got, why[POWERSGD] = [], _failure(e, Path(log))
            if got:
                ms = max(g["ms"][POWERSGD] for g in got)
                ddp = max(g["ms"][DDP_NAME] for g in got)
                why[POWERSGD] = (
                    f"{ms:.1f} ms, {ms / ddp:.2f}x its own ddp + fused adam (ranks of their own), "
                    f"{max(g['sent'] for g in got) / 1e6:.2f} MB/rank counted"
                )
        rows += _report(ws, names, results, why, args, label)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
