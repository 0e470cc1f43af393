"""Whole DDP iterations (forward, backward, step) of the 8M MLP and a small GPT, every way, same processes.

Variants, round-robin inside the same gloo ranks so that they share the machine's state:

* ``ddp + fused adam``: plain DDP, every rank holds all state (the unsharded baseline);
* ``ours default``: our optimizer at its defaults (sorted-greedy, DDP's all-reduce, step after
  backward);
* ``torch zero best``: DDP + torch's ZeroRedundancyOptimizer at its best (bucket views, fused
  Adam); torch's overlap mode refuses gloo (pytorch#62300), so it cannot be measured here;
* ``ours <partition>``: step after backward with ``reduce_scatter_hook`` (DDP's bytes);
* ``ours flat, ddp all-reduce``: the same without the hook (DDP all-reduces, then the step
  broadcasts: torch's 1.5x);
* ``ours overlap <partition>``: ``hook_with_zero_step_interleaved`` (the step inside backward);
* ``... + gather in forward``: ``overlap_param_gather=True`` (the parameter all-gather finishes
  when the next forward begins, after zero_grad and the batch);
* ``..., gloo reduce``: the same with the reduce onto owners as before issue 33, one gloo reduce
  per owner's run instead of one all-to-all (:mod:`zero_functional.comm.exchange`);
* ``..., at the hooks``: overlap mode with each bucket updated and gathered by the autograd
  thread at a later bucket's hook, as before the update thread
  (:func:`zero_functional.shell.overlap.threaded`).

The transformer-shaped model (``--models transformer``: ``_common.TinyGPT``, nanoGPT's layout
with 6 blocks of width 192, vocabulary 512, context 64, batch 8 per rank; 77 tensors, 2.9M
parameters) trains with AdamW: plain DDP + fused AdamW, torch's best, ours at the defaults, ours
flat with ``reduce_scatter_hook`` and ours in overlap mode (flat, interleaved hook).

RMSprop and Adagrad get DDP with that class, torch's best ZeRO for it (bucket views) and ours
(flat, after backward and in overlap mode). Prints the median iteration time of the slowest rank,
its ratio to the same optimizer's plain DDP and to torch's best ZeRO (time ratios: below 1 is
faster), the bytes each rank sends per iteration (counted from the collectives that ran, under
ring algorithms: see ``_common.ByteCounter``), and the largest parameter difference from the
same optimizer's plain DDP after the timed rounds (every variant trains the same data).

The floor, measured in the same rounds, piece by piece: forward and backward of the same model
without DDP; every gradient all-reduced in DDP's bucket sizes (what DDP sends); the same
buckets reduced onto their owners and broadcast back in even shares (what ZeRO at DDP's bytes
sends on gloo: one reduce and one broadcast per owner); fused Adam over every parameter (DDP)
and over one share (ZeRO). On two cores the collectives need the same CPU as the compute, so an
iteration costs about the sum of its pieces, and the last lines print the ratio those sums
predict for ZeRO over DDP. The ``floor`` row of the table is compute + the all-reduce at DDP's
bytes + one share's fused update: what no iteration that syncs its gradients and parameters on
this machine avoids (on gloo, DDP's all-reduce moves the same bytes as a reduce-scatter and an
all-gather; a ZeRO that sends them as a reduce and a broadcast per owner pays the
``reduce + broadcast per owner`` piece instead, printed beside it).

With ``--link RATE`` the script re-runs on a loopback shaped to RATE
(:mod:`zero_functional.app.link`), where bytes cost what they cost on a network, and each row
also shows its byte floor: the bytes every rank sends in one iteration (counted), together,
divided by the rate. ``--width 512 --numel 2097152`` is the 8 x Linear(512, 512) MLP of issue 33.

    python benchmarks/bench_iteration.py [--world-sizes 2 4] [--rounds 10] [--models mlp transformer]
        [--width 1000] [--link 2gbit] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import (
    ByteCounter,
    TinyGPT,
    add_link_argument,
    gpt_batch,
    median_ms,
    mlp,
    run_ranks,
    start_peak,
    status_mib,
)
from zero_functional import comm
from zero_functional.app.link import byte_floor_ms, run_shaped
from zero_functional.hooks import hook_with_zero_step_interleaved, reduce_scatter_hook
from zero_functional.optimizer import ZeroRedundancyOptimizer
from zero_functional.shell import overlap

ADAM_VARIANTS = [
    "ddp + fused adam",
    "torch zero best",
    "ours default",
    "ours sorted_greedy",
    "ours flat",
    "ours flat, ddp all-reduce",
    "ours overlap sorted_greedy",
    "ours overlap flat",
    "ours flat + gather in forward",
    "ours overlap flat + gather in forward",
    "ours flat, gloo reduce",
    "ours overlap flat, gloo reduce",
    "ours overlap flat, at the hooks",
]
GPT_VARIANTS = [
    "ddp + fused adamw",
    "torch zero best",
    "ours default",
    "ours flat",
    "ours overlap flat",
    "ours flat, gloo reduce",
    "ours overlap flat, gloo reduce",
    "ours overlap flat, at the hooks",
]
OTHER_VARIANTS = [
    "ddp + {o}",
    "torch zero best ({o})",
    "ours flat ({o})",
    "ours overlap flat ({o})",
]
CLASSES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {"lr": 1e-4}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-4}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-4}),
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-4}),
}


def variants(model: str, optimizers: list[str]) -> list[tuple[str, str]]:
    """(optimizer, variant) pairs; each optimizer's plain DDP and torch's best come first."""
    if model == "transformer":
        return [("adamw", name) for name in GPT_VARIANTS]
    out = [("adam", name) for name in ADAM_VARIANTS] if "adam" in optimizers else []
    for o in optimizers:
        if o != "adam":
            out += [(o, v.format(o=o)) for v in OTHER_VARIANTS]
    return out


def baseline(optimizer: str) -> str:
    return f"ddp + fused {optimizer}" if optimizer.startswith("adam") else f"ddp + {optimizer}"


def torch_best(optimizer: str) -> str:
    return "torch zero best" if optimizer.startswith("adam") else f"torch zero best ({optimizer})"


WIDTH = {"width": 1000}  # the MLP's (--width), set in each rank from its arguments


def _model(model: str, numel: int) -> nn.Module:
    return TinyGPT() if model == "transformer" else mlp(numel, width=WIDTH["width"])


def _inputs(model: str, rank: int) -> Tensor:
    if model == "transformer":
        return gpt_batch(rank)
    return torch.randn(32, WIDTH["width"], generator=torch.Generator().manual_seed(rank))


def _loss(module: nn.Module, x: Tensor) -> Tensor:
    """The loss of one batch: the GPT's next-token cross-entropy, the MLP's mean square."""
    if x.dtype == torch.int64:
        return TinyGPT.loss(module(x[:, :-1]), x[:, 1:])
    out: Tensor = module(x)
    return out.square().mean()


def _build(optimizer: str, name: str, model: str, numel: int, counting: bool) -> tuple[DDP, Any]:
    cls, kw = CLASSES[optimizer]
    # torch's best: bucket views, and the fused kernel where torch has one (Adam, AdamW)
    best = {"fused": True} if optimizer.startswith("adam") else {}
    # DDP's default buckets: 25 MB after a small first one (an explicit bucket_cap_mb drops it)
    ddp = DDP(_model(model, numel))
    if name in (baseline(optimizer), torch_best(optimizer)):
        if counting:  # DDP's built-in all-reduce runs in C++: the Python hook is the same, counted
            ddp.register_comm_hook(None, allreduce_hook)
        if name == baseline(optimizer):
            return ddp, cls(ddp.parameters(), **kw, **best)
        return ddp, TorchZero(ddp.parameters(), cls, parameters_as_bucket_view=True, **kw, **best)
    if name == "ours default":
        if counting:
            ddp.register_comm_hook(None, allreduce_hook)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), cls, **kw)
    partition = "flat" if "flat" in name else "sorted_greedy"
    overlap = "overlap" in name
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(),
        cls,
        overlap_with_ddp=overlap,
        partition=partition,
        overlap_param_gather="gather in forward" in name,
        **kw,
    )
    if overlap:
        hook = hook_with_zero_step_interleaved(
            allreduce_hook, ddp, zero, shard_buckets=partition == "sorted_greedy"
        )
        ddp.register_comm_hook(None, hook)
    elif "all-reduce" not in name:
        ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
    elif counting:
        ddp.register_comm_hook(None, allreduce_hook)
    return ddp, zero


FLOOR_COMPUTE = "forward + backward, no DDP"
FLOOR_ALLREDUCE = "all-reduce, DDP's buckets"
FLOOR_REDUCE_BCAST = "reduce + broadcast per owner"
FLOOR_ADAM = "fused update, every parameter"
FLOOR_ADAM_SHARE = "fused update, one share"
FLOORS = [FLOOR_COMPUTE, FLOOR_ALLREDUCE, FLOOR_REDUCE_BCAST, FLOOR_ADAM, FLOOR_ADAM_SHARE]
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


def _floors(
    optimizer: str, model_name: str, numel: int, world_size: int, x: torch.Tensor
) -> dict[str, Any]:
    """The pieces of an iteration, each on its own (see the module docstring)."""
    cls = CLASSES[optimizer][0]
    model = _model(model_name, numel)
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    flat = torch.randn(total) * 1e-3
    per_bucket = BUCKET_BYTES // flat.element_size()
    buckets = list(flat.split(per_bucket))
    adam = cls(params, lr=1e-4, fused=True)
    share = [torch.zeros(total // world_size, requires_grad=True)]
    share[0].grad = torch.randn_like(share[0]) * 1e-3
    adam_share = cls(share, lr=1e-4, fused=True)

    def compute() -> None:
        model.zero_grad()
        _loss(model, x).backward()

    def all_reduce() -> None:
        for w in [dist.all_reduce(b, async_op=True) for b in buckets]:
            w.wait()

    group = dist.group.WORLD
    assert group is not None

    def reduce_broadcast() -> None:  # through the package's comm: on gloo an all-to-all
        for start in (comm.start_reduce, comm.start_broadcast):
            pending = []
            for b in buckets:
                cuts = [len(t) for t in b.tensor_split(world_size)]
                ends = [sum(cuts[: r + 1]) for r in range(world_size)]
                runs = [(end - cut, end, r) for r, (cut, end) in enumerate(zip(cuts, ends))]
                pending.append(start(b, runs, group))
            for p in pending:
                p.wait()

    compute()  # .grad exists for Adam
    return {
        FLOOR_COMPUTE: compute,
        FLOOR_ALLREDUCE: all_reduce,
        FLOOR_REDUCE_BCAST: reduce_broadcast,
        FLOOR_ADAM: adam.step,
        FLOOR_ADAM_SHARE: adam_share.step,
    }


def _iteration(name: str, ddp: DDP, opt: Any, x: torch.Tensor) -> None:
    with _older_path(name):
        opt.zero_grad()
        _loss(ddp, x).backward()
        if "overlap" not in name:
            opt.step()


A_B: dict[str, tuple[Any, str]] = {
    ", gloo reduce": (comm.Wire, "exchanges"),  # the reduce onto owners before issue 33
    ", at the hooks": (overlap, "threaded"),  # overlap mode without its update thread
}
"""The A/B variants (same rounds): the predicate that picks the newer path, per name tag."""


@contextlib.contextmanager
def _older_path(name: str) -> Iterator[None]:
    """While an A/B variant (:data:`A_B`) runs, its predicate answers ``False``."""
    switched = [where for tag, where in A_B.items() if tag in name]
    originals = [getattr(module, attr) for module, attr in switched]
    for module, attr in switched:
        setattr(module, attr, lambda *args: False)
    try:
        yield
    finally:
        for (module, attr), original in zip(switched, originals):
            setattr(module, attr, original)


def _two_iterations(name: str, ddp: DDP, opt: Any, x: torch.Tensor) -> None:
    """Two iterations back to back, the parameter all-gather finished at the end: a
    ``gather in forward`` variant's first gather overlaps the second forward, and its last is
    timed too (were it left in flight, the next variant's time would pay for it)."""
    _iteration(name, ddp, opt, x)
    _iteration(name, ddp, opt, x)
    if hasattr(opt, "finish_param_sync"):
        opt.finish_param_sync()


def _worker(
    rank: int,
    world_size: int,
    model: str,
    numel: int,
    rounds: int,
    optimizers: list[str],
    width: int = 1000,
) -> dict[str, Any]:
    torch.set_num_threads(max(1, 2 // world_size))
    WIDTH["width"] = width
    x = _inputs(model, rank)
    pairs = variants(model, optimizers)
    built = {name: _build(o, name, model, numel, counting=False) for o, name in pairs}
    built_names = set(built)  # timed two iterations at a time
    first = pairs[0][0]
    floors = _floors(first, model, numel, world_size, x) if first.startswith("adam") else {}
    times: dict[str, list[float]] = {name: [] for name in [*(n for _, n in pairs), *floors]}
    for r in range(rounds + 2):
        calls: list[tuple[str, Any]] = [
            (name, lambda n=name, d=ddp, o=opt: _two_iterations(n, d, o, x))
            for name, (ddp, opt) in built.items()
        ]
        for name, call in [*calls, *floors.items()]:
            dist.barrier()
            t0 = time.perf_counter()
            call()
            if r >= 2:  # two warm-up rounds for every variant alike
                times[name].append(time.perf_counter() - t0)
    del floors
    for _, opt in built.values():
        if hasattr(opt, "finish_param_sync"):
            opt.finish_param_sync()
    diff = {}
    for o, name in pairs:
        base = built[baseline(o)][0].module.parameters()
        mine = built[name][0].module.parameters()
        diff[name] = max((a - b).abs().max().item() for a, b in zip(mine, base))
    del built
    sent: dict[str, float] = {}
    counter = ByteCounter()
    for o, name in pairs:
        ddp, opt = _build(o, name, model, numel, counting=True)
        for _ in range(2):  # past DDP's first-iteration buckets and overlap's adoption
            _iteration(name, ddp, opt, x)
        counter.reset()
        with counter.counting():
            _iteration(name, ddp, opt, x)
        sent[name] = counter.sent
        del ddp, opt
    ms = {k: median_ms(v) / (2 if k in built_names else 1) for k, v in times.items()}
    return {"ms": ms, "sent": sent, "diff": diff}


def _memory_worker(
    rank: int, world_size: int, model: str, numel: int, optimizer: str, name: str, width: int
) -> tuple[float, float]:
    """Peak resident-set growth (MiB) over building one variant and running four iterations
    (its parameter all-gather finished), after a warm-up of the process group's buffers; and
    over the last two of them (the steady state)."""
    torch.set_num_threads(max(1, 2 // world_size))
    WIDTH["width"] = width
    x = _inputs(model, rank)
    warm = DDP(nn.Linear(4, 4))
    warm(torch.ones(2, 4)).sum().backward()
    dist.barrier()
    del warm
    before = start_peak()
    ddp, opt = _build(optimizer, name, model, numel, counting=False)
    _two_iterations(name, ddp, opt, x)  # DDP's rebuilt buckets, overlap mode's adoption
    warm = status_mib("VmHWM") - before
    Path("/proc/self/clear_refs").write_text("5")  # the peak of what follows, from here
    _two_iterations(name, ddp, opt, x)
    return max(warm, status_mib("VmHWM") - before), status_mib("VmHWM") - before


def _memory(model: str, ws: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--memory``: each variant's peak in ranks of its own; printed against torch's best."""
    pairs = variants(model, args.optimizers)
    peak, steady = {}, {}
    for o, name in pairs:
        got = run_ranks(_memory_worker, ws, model, args.numel, o, name, args.width, timeout_s=600)
        peak[name], steady[name] = max(g[0] for g in got), max(g[1] for g in got)
    print(
        f"{'peak MiB/rank (ranks of its own)':<38}{'all':>9}{'x torch best':>14}"
        f"{'steady':>9}{'x torch best':>14}"
    )
    rows = []
    for o, name in pairs:
        best, best_steady = peak[torch_best(o)], steady[torch_best(o)]
        print(
            f"  {name:<36}{peak[name]:>9.1f}{peak[name] / best:>13.3f}x"
            f"{steady[name]:>9.1f}{steady[name] / best_steady:>13.3f}x"
        )
        rows.append(
            {
                "benchmark": f"iteration peak ({model})",
                "world_size": ws,
                "variant": name,
                "peak_mib": peak[name],
                "vs_torch_best": peak[name] / best,
                "steady_peak_mib": steady[name],
                "steady_vs_torch_best": steady[name] / best_steady,
            }
        )
    return rows


def _report(
    model: str, ws: int, results: list[dict[str, Any]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Print one world size's table; its rows for ``--json``."""
    pairs = variants(model, args.optimizers)
    n_params = sum(p.numel() for p in _model(model, args.numel).parameters())
    layers = f"{WIDTH['width']}-wide " if WIDTH["width"] != 1000 else ""
    label = (
        f"{n_params / 1e6:.1f}M {layers}MLP"
        if model == "mlp"
        else f"{n_params / 1e6:.1f}M transformer"
    )
    if args.link:
        label += f" on {args.link}"
    rows = []
    print(f"\n== {label}, world size {ws}, median of {args.rounds} rounds")
    floor_head = f"{'floor ms':>10}{'x floor':>9}" if args.link else ""
    print(
        f"{'variant':<38}{'iter ms':>9}{'x ddp':>8}{'x torch best':>14}"
        f"{'MB sent/rank':>14}{'x ddp bytes':>13}{'max|dp| vs ddp':>16}{floor_head}"
    )
    for o, name in pairs:
        ms = max(r["ms"][name] for r in results)  # the slowest rank
        base = max(r["ms"][baseline(o)] for r in results)
        best = max(r["ms"][torch_best(o)] for r in results)
        mb = max(r["sent"][name] for r in results)
        ddp_mb = max(r["sent"][baseline(o)] for r in results)
        diff = max(r["diff"][name] for r in results)
        row: dict[str, Any] = {
            "benchmark": f"iteration ({label})",
            "world_size": ws,
            "variant": name,
            "ms": ms,
            "vs_torch_best": ms / best,
            "vs_ddp": ms / base,
            "mb_sent": mb / 1e6,
        }
        floor_cols = ""
        if args.link:  # every rank's counted bytes, together, over the one shared link
            floor = byte_floor_ms(sum(r["sent"][name] for r in results), args.link)
            row.update(floor_ms=floor, vs_floor=ms / floor)
            floor_cols = f"{floor:>10.1f}{ms / floor:>8.2f}x"
        print(
            f"{name:<38}{ms:>9.1f}{ms / base:>7.2f}x{ms / best:>13.2f}x"
            f"{mb / 1e6:>14.1f}{mb / ddp_mb:>12.2f}x{diff:>16.1e}{floor_cols}"
        )
        rows.append(row)
    first = pairs[0][0]
    if not first.startswith("adam"):
        return rows
    piece = {f: max(r["ms"][f] for r in results) for f in FLOORS}
    ddp_ms = max(r["ms"][baseline(first)] for r in results)
    best = max(r["ms"][torch_best(first)] for r in results)
    floor = piece[FLOOR_COMPUTE] + piece[FLOOR_ALLREDUCE] + piece[FLOOR_ADAM_SHARE]
    print(
        f"{'floor: compute+all-reduce+one share':<38}{floor:>9.1f}{floor / ddp_ms:>7.2f}x"
        f"{floor / best:>13.2f}x"
    )
    rows.append(
        {
            "benchmark": f"iteration ({label})",
            "world_size": ws,
            "variant": "floor: compute + all-reduce + one share",
            "ms": floor,
            "vs_torch_best": floor / best,
        }
    )
    print(f"{'floor, piece by piece (' + first + ')':<38}{'ms':>9}{'x ddp':>8}{'x torch best':>14}")
    for f in FLOORS:
        print(f"  {f:<36}{piece[f]:>9.1f}{piece[f] / ddp_ms:>7.2f}x{piece[f] / best:>13.2f}x")
    ddp_sum = piece[FLOOR_COMPUTE] + piece[FLOOR_ALLREDUCE] + piece[FLOOR_ADAM]
    zero_sum = piece[FLOOR_COMPUTE] + piece[FLOOR_REDUCE_BCAST] + piece[FLOOR_ADAM_SHARE]
    print(
        f"  {'sum, DDP (compute+all-reduce+all)':<36}{ddp_sum:>9.1f}"
        f"{ddp_sum / ddp_ms:>7.2f}x\n"
        f"  {'sum, ZeRO (compute+red/bcast+share)':<36}{zero_sum:>9.1f}"
        f"{zero_sum / ddp_ms:>7.2f}x\n"
        f"  predicted ZeRO at DDP's bytes / DDP on this machine: {zero_sum / ddp_sum:.2f}x"
    )
    for f in FLOORS:
        rows.append(
            {
                "benchmark": f"iteration ({label})",
                "world_size": ws,
                "variant": f"floor: {f}",
                "ms": piece[f],
                "vs_torch_best": piece[f] / best,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument(
        "--numel",
        type=int,
        help="the MLP's size (8 layers: 8,000,000; with --link 8 x 512 x 512 = 2,097,152)",
    )
    ap.add_argument(
        "--models",
        nargs="+",
        choices=["mlp", "transformer"],
        default=["mlp", "transformer"],
        help="the 8-Linear MLP (--numel) and the 2.9M transformer (AdamW only)",
    )
    ap.add_argument(
        "--optimizers",
        nargs="+",
        choices=["adam", "rmsprop", "adagrad"],
        help="the MLP's: Adam gets every variant; the others plain DDP, torch's best and ours "
        "(default: all three; with --link Adam)",
    )
    ap.add_argument("--width", type=int, help="the MLP's layer width (1000; with --link 512)")
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    ap.add_argument(
        "--memory",
        action="store_true",
        help="also each variant's peak memory per rank over four iterations, in ranks of its own",
    )
    add_link_argument(ap)
    args = ap.parse_args()
    run_shaped(args.link)
    # on a shaped link, issue 33's model (8 x Linear(512, 512)) and Adam: the bytes decide
    args.width = args.width or (512 if args.link else 1000)
    args.numel = args.numel or 8 * args.width * args.width
    args.optimizers = args.optimizers or (["adam"] if args.link else ["adam", "rmsprop", "adagrad"])
    WIDTH["width"] = args.width
    rows = []
    for model in args.models:
        for ws in args.world_sizes:
            results = run_ranks(
                _worker,
                ws,
                model,
                args.numel,
                args.rounds,
                args.optimizers,
                args.width,
                timeout_s=1800,
            )
            rows += _report(model, ws, results, args)
            if args.memory:
                rows += _memory(model, ws, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
