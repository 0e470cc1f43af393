"""The ``zero-functional`` command line: ``train``, ``demo``, ``plan`` and ``bench``.

Every error a user can cause (a bad flag, a missing or corrupt checkpoint, an unknown model)
ends in one line on stderr and exit code 2, before any process is spawned or file written.

Example:
    >>> main(["plan", "gpt2-small", "--world-sizes", "2"])  # doctest: +ELLIPSIS
    gpt2-small: 148 tensors, 124,439,808 parameters, largest 38,597,376 (31.0%)...
    0
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from zero_functional import __version__
from zero_functional.app.cli_args import IntIn, Parser, fail, local_ranks, shown
from zero_functional.app.cluster import cluster_rank
from zero_functional.app.launch import CHILD_ENV
from zero_functional.app.link import rate_bits, run_shaped
from zero_functional.app.models import MODELS, model_shapes, muon_params, numels
from zero_functional.app.plan_format import (
    DTYPE_BYTES,
    format_hybrid,
    format_memory,
    format_muon,
    format_plan,
    format_snapshots,
    format_wire,
)
from zero_functional.app.train_options import add_flags, train_config
from zero_functional.core.loads import hybrid_shape

LINK_SCRIPTS = ("bench_collectives.py", "bench_iteration.py", "bench_phases.py")
"""The benchmarks ``bench --link`` runs: those that measure what bytes cost."""
NOT_QUICK = {  # in the order the scripts run
    "bench_compressed_training.py": "it trains 8 runs of a few hundred steps: minutes",
    "bench_lowbit_compiled.py": "it compiles torchao's AdamW8bit step for each piece shape; "
    "run it without --quick",
}
"""The benchmarks ``bench --quick`` leaves out, and why."""
QUICK_ARGS = {
    "bench_iteration.py": ("--models", "mlp"),
    "bench_step.py": ("--models", "mlp"),
    "bench_compressed_error.py": ("--models", "mlp"),
    "bench_snapshots.py": ("--models", "mlp", "--no-recovery"),  # the torchrun restarts: a minute
}
"""What ``bench --quick`` passes a script besides the shared flags: the MLP, not the GPT too."""
QUICK_TAKES = "about 100 s on 2 idle cores: each starts its own ranks and times every variant"
"""What ``bench --quick`` says of its time (not under a minute), before it starts."""
DEMO_WORLD_SIZES = (2, 8, 64)  # the world sizes ``plan`` reports by default, and the demo's plan
MAX_SIMULATED_RANKS = 64
"""Most ranks ``plan --simulate`` builds per world size (each takes up to a second)."""
world_sizes = IntIn(1, 1 << 20, "2**20 ranks is more than any cluster has")


def rank_list(text: str) -> list[int]:
    """An argparse type: ranks separated by commas (``0,1023``), each an integer >= 0.

    Example:
        >>> rank_list("0, 1023")
        [0, 1023]
    """
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in parts) or len(parts) > MAX_SIMULATED_RANKS:
        raise argparse.ArgumentTypeError(
            f"expected up to {MAX_SIMULATED_RANKS} ranks (integers >= 0) separated by commas, "
            f"such as 0,1023, got {shown(text)}"
        )
    return [int(part) for part in parts]


def _cmd_plan(args: argparse.Namespace) -> int:
    here = os.getcwd()  # first on sys.path, as python -m has it (the script's is its bin/)
    if args.model not in MODELS and all(os.path.abspath(p or ".") != here for p in sys.path):
        sys.path.insert(0, here)
    dtype, worlds = args.dtype or "fp32", args.world_sizes
    try:
        shapes, muon = muon_params(args.model) if args.muon else (model_shapes(args.model), [])
    except ValueError as e:
        return fail("plan", str(e))
    if not shapes:
        return fail("plan", f"model {args.model!r} has no parameters; nothing to partition")
    if args.muon and not any(muon):
        return fail(
            "plan",
            f"--muon: model {args.model!r} has no hidden 2-D matrix for Muon (torch.optim.Muon "
            "takes 2-D parameters only; embeddings and heads go to AdamW): drop --muon",
        )
    if args.optimizer not in (None, "adamw"):
        from zero_functional.functional.lowbit import LOW_BIT  # imports torch: not for --help

        if args.optimizer not in LOW_BIT:
            names = ", ".join(("adamw", *LOW_BIT))
            return fail("plan", f"--optimizer: expected one of {names}, got {args.optimizer!r}")
    if args.remainders and (args.dtype != "bf16" or args.main_params != "fp32"):
        return fail(
            "plan",
            "--remainders keeps the fp32 main copy as bf16 parameters + int16 remainders: it "
            "needs --dtype bf16 --main-params fp32",
        )
    if args.shard_size is not None:
        try:
            for w in worlds:
                hybrid_shape(w, args.shard_size)
        except ValueError as e:
            return fail("plan", f"--shard-size: {e} (--world-sizes)")
    if bad := [(r, w) for w in worlds for r in args.simulate or () if not 0 <= r < w]:
        r, w = bad[0]  # before torch is imported
        return fail(
            "plan",
            f"--simulate: rank {r} is not a rank of world size {w}: pass ranks from 0 to {w - 1}",
        )
    if args.simulate is not None:
        from zero_functional.app.simulate import format_simulated, model_params, simulate

        try:
            params = model_params(shapes, dtype)
        except ValueError as e:
            return fail("plan", f"--simulate: {e}")
    n = numels(shapes)
    print(format_plan(args.model, n, worlds))
    main_params = "fp32" if args.gather_dtype else args.main_params  # implied
    if args.dtype or main_params or args.optimizer or args.remainders or args.ema:
        optimizer = args.optimizer or "adamw"
        changes = args.gather_dtype is not None
        m = format_memory(
            n, worlds, dtype, main_params, optimizer, args.remainders, args.ema, changes
        )
        print(f"\n{m}")
    if args.snapshots:
        optimizer, changes = args.optimizer or "adamw", args.gather_dtype is not None
        snaps = format_snapshots(n, worlds, dtype, main_params, optimizer, changes)
        print(f"\n{snaps}")
    if args.wire_dtype or args.gather_dtype:
        print(f"\n{format_wire(n, worlds, dtype, args.wire_dtype, args.gather_dtype)}")
    if args.shard_size is not None:
        print(f"\n{format_hybrid(n, worlds, args.shard_size, dtype, args.main_params)}")
    if args.simulate is not None:
        main = args.main_params is not None and DTYPE_BYTES[dtype] < 4
        rows = [
            simulate(params, w, r, partition=p, shard_size=args.shard_size, main_params=main)
            for w in worlds
            for r in args.simulate
            for p in ("sorted_greedy", "flat")
        ]
        print(f"\n{format_simulated(rows)}")
    if args.muon:
        print(f"\n{format_muon(shapes, muon, worlds)}")
    return 0


def _load_checkpoint(path: str) -> Mapping[str, Any]:
    from zero_functional.app.train import load_checkpoint  # torch: only for a resume

    return load_checkpoint(path)


def _cmd_train(args: argparse.Namespace) -> int:
    try:
        where = cluster_rank(os.environ)
        if where is not None:  # before torch is imported: c10d's warnings as the launcher's ranks
            os.environ.update({k: v for k, v in CHILD_ENV.items() if k not in os.environ})
        cfg = train_config(args, where, _load_checkpoint)
    except ValueError as e:
        return fail(args.command, str(e))
    from zero_functional.app import train

    if where is not None:
        return train.run_torchrun(cfg, where)
    return train.launch(cfg, cfg.nproc, timeout_s=cfg.timeout)


def _cmd_demo(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    code = _cmd_train(args)
    if code:
        return code
    print()
    # parsed as the command line would: a flag added to ``plan`` gets its default here too
    plan_argv = ["plan", "gpt2-small", "--world-sizes", *map(str, DEMO_WORLD_SIZES)]
    code = _cmd_plan(build_parser().parse_args(plan_argv))
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s")
    return code


def format_bench(rows: Sequence[dict[str, object]]) -> str:
    """One table of benchmark rows (``benchmarks/bench_*.py --json``'s): ``x torch best`` is the
    variant's time over torch's best configuration's in the same run (below 1: faster).

    Example:
        >>> print(format_bench([
        ...     {"benchmark": "step", "world_size": 2, "variant": "torch best", "ms": 40.0,
        ...      "vs_torch_best": 1.0},
        ...     {"benchmark": "step", "world_size": 2, "variant": "ours", "ms": 32.0,
        ...      "vs_torch_best": 0.8, "mb_sent": 16.0},
        ... ]))
        benchmark  ranks  variant         ms  x torch best  MB sent/rank
        step           2  torch best    40.0         1.00x             -
        step           2  ours          32.0         0.80x          16.0
    """
    if not rows:
        return "(no benchmark rows)"
    bench_w = max(len("benchmark"), *(len(str(r["benchmark"])) for r in rows))
    var_w = max(len("variant"), *(len(str(r["variant"])) for r in rows))
    extra = "mb_sent" in {k for r in rows for k in r}
    lines = [
        f"{'benchmark':<{bench_w}}  ranks  {'variant':<{var_w}}  {'ms':>6}  x torch best"
        + ("  MB sent/rank" if extra else "")
    ]
    for r in rows:
        line = (
            f"{str(r['benchmark']):<{bench_w}}  {r['world_size']:>5}  {str(r['variant']):<{var_w}}"
            f"  {float(str(r['ms'])):>6.1f}  {float(str(r['vs_torch_best'])):>11.2f}x"
        )
        if extra:
            mb = r.get("mb_sent")
            line += f"  {float(str(mb)):>12.1f}" if mb is not None else f"  {'-':>12}"
        lines.append(line)
    return "\n".join(lines)


def link_rate(text: str) -> str:
    """An argparse type: a ``tc`` rate such as ``2gbit`` (:func:`~.link.rate_bits`).

    Example:
        >>> link_rate("10gbit")
        '10gbit'
    """
    try:
        rate_bits(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _cmd_bench(args: argparse.Namespace) -> int:
    bench_dir = Path(args.dir or Path(__file__).resolve().parents[3] / "benchmarks")
    scripts = sorted(p for p in bench_dir.glob("bench_*.py")) if bench_dir.is_dir() else []
    if not scripts:
        return fail(
            "bench",
            f"no benchmarks/bench_*.py under {bench_dir}; run from a source checkout or pass --dir",
        )
    if args.link:  # the scripts that measure bytes on a link (issue 33)
        scripts = [s for s in scripts if s.name in LINK_SCRIPTS]
    total = len(scripts)
    if args.quick:
        for s in scripts:
            if s.name in NOT_QUICK:
                print(f"-- left out by --quick: {s.name} ({NOT_QUICK[s.name]})")
        scripts = [s for s in scripts if s.name not in NOT_QUICK]
    if args.list:
        print("\n".join(str(s) for s in scripts))
        return 0
    run_shaped(args.link)  # re-runs this command on the shaped link, or returns there
    forwarded: list[str] = []
    for flag, given, quick in (
        ("--world-sizes", args.world_sizes, [2]),
        ("--rounds", args.rounds and [args.rounds], [3]),
        ("--numel", args.numel and [args.numel], [2_000_000]),
        ("--link", args.link and [args.link], None),
    ):
        values = given or (quick if args.quick else None)
        forwarded += [flag, *map(str, values)] if values else []
    rows: list[dict[str, object]] = []
    worst = 0
    if args.quick:
        print(f"-- bench --quick runs {len(scripts)} of {total} scripts, {QUICK_TAKES}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, script in enumerate(scripts, 1):
            out = Path(tmp) / f"{script.stem}.json"
            doc = ast.get_docstring(ast.parse(script.read_text()))  # what it measures
            what = doc.splitlines()[0] if doc else "(no docstring)"
            print(f"== {script.name} ({i}/{len(scripts)}): {what}", flush=True)
            began = time.perf_counter()
            extra = QUICK_ARGS.get(script.name, ()) if args.quick else ()
            code = subprocess.run(
                [sys.executable, str(script), *forwarded, *extra, "--json", str(out)], check=False
            ).returncode
            now = time.perf_counter()
            print(f"-- {script.name}: {now - began:.0f} s ({now - start:.0f} s in all)")
            worst = max(worst, code)
            if code == 0 and out.is_file():
                rows.extend(json.loads(out.read_text()))
    print("\n== summary: every benchmark against torch's best configuration, same run")
    print(format_bench(rows))
    return worst


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``zero-functional`` (for ``--help`` and the tests)."""
    parser = Parser(
        prog="zero-functional",
        description="ZeRO stage-1 sharded optimizers for PyTorch DDP: demo job, plans, benchmarks.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser(
        "train",
        help="train an MLP on sklearn's digits with DDP + ZeroRedundancyOptimizer(Adam)",
        description="Spawns --nproc gloo ranks on 127.0.0.1, or joins the group of torchrun, "
        "SLURM (srun, one task per process) or a PyTorchJob.",
    )
    add_flags(train)
    train.set_defaults(func=_cmd_train)
    demo = sub.add_parser("demo", help="what `make demo` runs: a short train, then a plan")
    add_flags(demo, epochs=20)
    demo.set_defaults(func=_cmd_demo)
    plan = sub.add_parser(
        "plan",
        help="balance of sorted-greedy and flat partitions for a model (pure, instant)",
        description="MODEL: a built-in spec or module:function returning an nn.Module "
        "(built on the meta device).",
    )
    plan.add_argument("model", metavar="MODEL", help=f"{', '.join(MODELS)}, or module:function")
    plan.add_argument(
        "--world-sizes",
        type=world_sizes,
        nargs="+",
        default=list(DEMO_WORLD_SIZES),
        help=f"world sizes to report (2 8 64; {world_sizes})",
    )
    plan.add_argument(
        "--dtype",
        choices=tuple(DTYPE_BYTES),
        help="parameters' and gradients' dtype (fp32); with it or --main-params, also print "
        "the bytes per rank of parameters, gradients, main copy and AdamW state",
    )
    plan.add_argument(
        "--main-params",
        choices=("fp32",),
        help="an fp32 main copy of the owned pieces of narrower parameters, with fp32 state "
        "(main_params_dtype=torch.float32; default: none)",
    )
    for flag, what in (
        ("--wire-dtype", "gradients cross to their owners in"),
        ("--gather-dtype", "parameters' changes cross (from fp32 main copies) in"),
    ):
        plan.add_argument(
            flag,
            choices=("bf16", "fp16", "int8", "fp8"),
            help=f"{what} this format: print the bytes per rank and step beside DDP's",
        )
    plan.add_argument(
        "--snapshots",
        action="store_true",
        help="print the host memory per rank that checkpoint.snapshot's in-memory snapshots "
        "take: its share, the copy of another rank's it keeps, and the peak while a new one is "
        "taken",
    )
    plan.add_argument(
        "--shard-size",
        type=world_sizes,
        metavar="S",
        help="also print hybrid sharding (state sharded within groups of S ranks, a node, and "
        "replicated across world/S): state per rank and bytes per rank and step within and "
        "across nodes; S must divide every world size",
    )
    plan.add_argument(
        "--simulate",
        type=rank_list,
        metavar="RANKS",
        help="also build the optimizer as these ranks (such as 0,1023) of each world size "
        "would, under torch's fake process group, step once, and print what each holds",
    )
    plan.add_argument(
        "--muon",
        action="store_true",
        help="also print Muon (hidden 2-D matrices, owned whole, balanced by Newton-Schulz cost) "
        "+ AdamW (the rest, split flat): state bytes and cost per rank, and their max/mean",
    )
    plan.add_argument(
        "--optimizer",
        metavar="NAME",
        help="the state's optimizer for the bytes per rank: adamw (default) or torchao's "
        "low-bit adamw8bit, adamw4bit, adamwfp8 (block-quantized moments, for tensors of >= "
        "4096 elements)",
    )
    plan.add_argument(
        "--remainders",
        action="store_true",
        help="the fp32 main copy kept as the bf16 parameter + an int16 remainder "
        "(store_param_remainders=True): 2 B per owned element instead of 4",
    )
    plan.add_argument(
        "--ema",
        action="store_true",
        help="an EMA of the weights (ShardedEMA): each owner keeps its pieces' in fp32",
    )
    plan.set_defaults(func=_cmd_plan)
    bench = sub.add_parser(
        "bench", help="run benchmarks/bench_*.py and print one table of ratios against torch's best"
    )
    bench.add_argument("--list", action="store_true", help="only list the scripts")
    bench.add_argument(
        "--quick",
        action="store_true",
        help="2 ranks, 3 rounds, 2M parameters, the MLP alone, nothing compiled (a smoke run)",
    )
    bench.add_argument(
        "--world-sizes",
        type=local_ranks,
        nargs="+",
        help=f"(scripts: 2 4; {local_ranks}, ranks on this machine)",
    )
    bench.add_argument(
        "--rounds",
        type=IntIn(1, 10_000, "more do not move a median"),
        help="timed rounds per variant (at most 10,000)",
    )
    bench.add_argument(
        "--numel",
        type=IntIn(1, 1_000_000_000, "4 GB per fp32 copy, several per rank"),
        help="model parameters (8,000,000; at most 1,000,000,000)",
    )
    bench.add_argument(
        "--link",
        metavar="RATE",
        type=link_rate,
        help="run the link benchmarks (bench_collectives, bench_iteration, bench_phases) on a loopback shaped "
        "to RATE (2gbit, 10gbit) in a private network namespace, with each row's byte floor",
    )
    bench.add_argument("--dir", help="the benchmarks directory (default: the checkout's)")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``zero-functional`` with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))
