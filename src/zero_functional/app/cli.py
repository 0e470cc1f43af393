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
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from zero_functional import __version__
from zero_functional.app.cli_args import (
    DEMO_WORLD_SIZES,
    DIGITS_TRAIN_SIZE,
    MAX_BENCH_NUMEL,
    MAX_BENCH_ROUNDS,
    MAX_BUCKET_CAP_MB,
    MAX_EPOCHS,
    MAX_HIDDEN,
    MAX_LOCAL_RANKS,
    MAX_TIMEOUT_S,
    SEED_RANGE,
    Parser,
    fail,
    int_in,
    local_ranks,
    positive_float,
)
from zero_functional.app.cluster import ClusterError, ClusterRank, cluster_rank
from zero_functional.app.link import rate_bits, run_shaped
from zero_functional.app.plan_cmd import add_plan_parser, cmd_plan
from zero_functional.app.plan_format import (
    DTYPE_BYTES,
    format_memory,
    format_plan,
)
from zero_functional.app.preempt import DEFAULT_GRACE_S

__all__ = ["DTYPE_BYTES", "build_parser", "format_bench", "format_memory", "format_plan", "main"]


# ----------------------------------------------------------------------------- train / demo


def _cluster_rank() -> ClusterRank | None:
    """Where torchrun, SLURM or a PyTorchJob put this process; None: ``train`` spawns its ranks."""
    return cluster_rank(os.environ)


DEMO_MODULES = {"sklearn": "scikit-learn", "tqdm": "tqdm"}
"""What the train job imports beyond torch (module: distribution), from the ``demo`` extra."""


def _missing_modules(modules: dict[str, str]) -> list[str]:
    """The distributions of the modules that cannot be imported, found without importing them."""
    missing = []
    for module, distribution in modules.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(distribution)
    return missing


def _unwritable_directory(path: Path) -> str | None:
    """Why no file can be created in ``path``, or None if one can (the test leaves no file)."""
    try:
        # on Linux an unnamed O_TMPFILE: nothing appears in the directory, even for a moment
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def _train_config(args: argparse.Namespace, command: str) -> tuple[object, int]:
    """The job's config after every check a parent can make; ``(config, 0)`` or ``(None, 2)``.

    The checks that need no torch come first, so that those errors answer at once.
    """
    try:
        where = _cluster_rank()
    except ClusterError as e:
        return None, fail(command, str(e))
    missing = _missing_modules(DEMO_MODULES)
    if missing:
        return None, fail(
            command,
            f"the train job needs {' and '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed: "
            "pip install 'zero_functional[demo]'",
        )
    if args.batch_size < args.nproc:
        return None, fail(
            command, f"--batch-size {args.batch_size} is smaller than --nproc {args.nproc}"
        )
    if args.overlap and args.impl == "torch":
        return None, fail(
            command,
            "--overlap with --impl torch hangs on gloo (pytorch#62300); drop one of the two",
        )
    if args.main_params and args.impl == "torch":
        return None, fail(
            command,
            "--main-params fp32 needs --impl zero_functional: torch's ZeroRedundancyOptimizer "
            "keeps no main copy",
        )
    if args.shard_size is not None:
        if args.impl == "torch":
            return None, fail(
                command,
                "--shard-size needs --impl zero_functional: torch's ZeroRedundancyOptimizer "
                "takes no device mesh",
            )
        from zero_functional.core.loads import hybrid_shape

        world = where.world_size if where is not None else args.nproc
        try:
            hybrid_shape(world, args.shard_size)
        except ValueError as e:
            whose = f"{where.source}'s world size" if where is not None else "--nproc"
            return None, fail(command, f"--shard-size: {e} ({whose})")
    if args.main_params and args.dtype == "fp32":
        return None, fail(
            command,
            "--main-params fp32 with --dtype fp32: fp32 parameters need no main copy; "
            "pass --dtype bf16",
        )
    if args.dtype != "fp32" and (args.checkpoint or args.resume):
        return None, fail(
            command,
            f"--dtype {args.dtype} with --checkpoint/--resume is not supported yet; "
            "checkpoint an fp32 run",
        )
    if args.checkpoint is not None:
        parent = Path(args.checkpoint).resolve().parent
        if not parent.is_dir():
            return None, fail(command, f"--checkpoint directory {parent} does not exist")
        # ours writes a sharded checkpoint (a directory); torch's class, one consolidated file
        sharded = args.impl == "zero_functional"
        if sharded and Path(args.checkpoint).is_file():
            return None, fail(
                command,
                f"--checkpoint {args.checkpoint} is a file (a single-file checkpoint); a sharded "
                "checkpoint is a directory: pass a new path",
            )
        if not sharded and Path(args.checkpoint).is_dir():
            return None, fail(
                command,
                f"--checkpoint {args.checkpoint} is a directory; --impl torch writes one "
                "consolidated file: pass a file path",
            )
        why = _unwritable_directory(parent)
        if why is not None:
            return None, fail(
                command,
                f"--checkpoint {args.checkpoint}: cannot create files in {parent} ({why}); "
                "pass a path in a writable directory",
            )
    if args.overlap:
        try:
            import zero_functional.hooks  # noqa: F401
        except ImportError as e:
            return None, fail(command, f"--overlap needs zero_functional.hooks, which fails: {e}")
    from zero_functional.app.train import CheckpointError, TrainConfig, load_checkpoint

    hidden: int | None = args.hidden
    if args.resume is not None:
        try:
            ckpt = load_checkpoint(args.resume)
        except CheckpointError as e:
            return None, fail(command, str(e))
        if int(ckpt["epoch"]) >= args.epochs:
            return None, fail(
                command,
                f"checkpoint {args.resume} has finished epoch {ckpt['epoch']} of --epochs "
                f"{args.epochs}; pass --epochs {int(ckpt['epoch']) + 1} or more to continue",
            )
        saved = int(ckpt["args"]["hidden"])
        if hidden is not None and hidden != saved:
            return None, fail(
                command,
                f"--hidden {hidden} conflicts with checkpoint {args.resume}, whose model has "
                f"hidden {saved}; drop --hidden (a resumed run takes the checkpoint's)",
            )
        hidden = saved
    if args.impl == "zero_functional":
        try:
            import zero_functional.optimizer  # noqa: F401
        except ImportError as e:
            return None, fail(
                command, f"zero_functional.optimizer does not import ({e}); try --impl torch"
            )
    try:
        cfg = TrainConfig(
            epochs=args.epochs,
            lr=args.lr,
            seed=args.seed,
            batch_size=args.batch_size,
            overlap=args.overlap,
            checkpoint=args.checkpoint,
            resume=args.resume,
            impl=args.impl,
            reference=not args.no_reference,
            progress=not args.no_progress,
            bucket_cap_mb=args.bucket_cap_mb,
            partition=args.partition.replace("-", "_"),
            hidden=TrainConfig.hidden if hidden is None else hidden,
            dtype=args.dtype,
            main_params=args.main_params,
            shard_size=args.shard_size,
            grace_s=args.grace_s,
            save_every=args.save_every,
        )
    except ValueError as e:
        return None, fail(command, str(e))
    return cfg, 0


def _cmd_train(args: argparse.Namespace) -> int:
    cfg, code = _train_config(args, args.command)
    if code:
        return code
    from zero_functional.app.train import TrainConfig, launch, run_torchrun

    assert isinstance(cfg, TrainConfig)
    where = _cluster_rank()
    if where is not None:
        return run_torchrun(cfg, where)
    return launch(cfg, args.nproc, timeout_s=args.timeout)


def _cmd_demo(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    code = _cmd_train(args)
    if code:
        return code
    print()
    # the plan's own namespace, parsed as the command line would: every flag ``plan`` has
    # gets its default here, so a flag added to ``plan`` cannot break the demo
    plan_argv = ["plan", "gpt2-small", "--world-sizes", *map(str, DEMO_WORLD_SIZES)]
    code = cmd_plan(build_parser().parse_args(plan_argv))
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s")
    return code


# ----------------------------------------------------------------------------- bench


def _benchmarks_dir() -> Path:
    return Path(__file__).resolve().parents[3] / "benchmarks"


def format_bench(rows: Sequence[dict[str, object]]) -> str:
    """One table of benchmark rows (as the ``--json`` of ``benchmarks/bench_*.py`` writes them).

    ``x torch best`` is the variant's time over torch's best configuration's, measured in the
    same run: below 1 is faster (the checkpoint rows: save time).

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


LINK_SCRIPTS = ("bench_collectives.py", "bench_iteration.py", "bench_phases.py")
"""The benchmarks ``bench --link`` runs: those that measure what bytes cost."""


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
    bench_dir = Path(args.dir) if args.dir else _benchmarks_dir()
    scripts = sorted(p for p in bench_dir.glob("bench_*.py")) if bench_dir.is_dir() else []
    if not scripts:
        return fail(
            "bench",
            f"no benchmarks/bench_*.py under {bench_dir}; run from a source checkout or pass --dir",
        )
    if args.link:  # the scripts that measure bytes on a link (issue 33)
        scripts = [s for s in scripts if s.name in LINK_SCRIPTS]
    if args.list:
        print("\n".join(str(s) for s in scripts))
        return 0
    run_shaped(args.link)  # re-runs this command on the shaped link, or returns there
    world_sizes = args.world_sizes or ([2] if args.quick else None)
    rounds = args.rounds or (3 if args.quick else None)
    numel = args.numel or (2_000_000 if args.quick else None)
    forwarded: list[str] = []
    if world_sizes:
        forwarded += ["--world-sizes", *map(str, world_sizes)]
    if rounds:
        forwarded += ["--rounds", str(rounds)]
    if numel:
        forwarded += ["--numel", str(numel)]
    if args.link:
        forwarded += ["--link", args.link]
    rows: list[dict[str, object]] = []
    worst = 0
    with tempfile.TemporaryDirectory() as tmp:
        for script in scripts:
            out = Path(tmp) / f"{script.stem}.json"
            print(f"== {script.name}", flush=True)
            code = subprocess.run(
                [sys.executable, str(script), *forwarded, "--json", str(out)], check=False
            ).returncode
            worst = max(worst, code)
            if code == 0 and out.is_file():
                rows.extend(json.loads(out.read_text()))
    print("\n== summary: every benchmark against torch's best configuration, same run")
    print(format_bench(rows))
    return worst


# ----------------------------------------------------------------------------- parser


def _add_train_flags(p: argparse.ArgumentParser, *, epochs: int) -> None:
    p.add_argument(
        "--nproc",
        type=local_ranks,
        default=2,
        help=f"local ranks to spawn (2; 1 to {MAX_LOCAL_RANKS})",
    )
    p.add_argument(
        "--epochs",
        type=int_in(1, MAX_EPOCHS, "a million epochs already take days"),
        default=epochs,
        help=f"epochs ({epochs}; at most {MAX_EPOCHS:,})",
    )
    p.add_argument(
        "--lr",
        type=positive_float(math.inf, ""),
        default=1e-3,
        help="Adam learning rate (1e-3)",
    )
    p.add_argument(
        "--seed",
        type=int_in(*SEED_RANGE, "", span="in torch.manual_seed's range, -2**63 to 2**64-1"),
        default=0,
        help="init and data-order seed (0; -2**63 to 2**64-1, torch.manual_seed's range)",
    )
    p.add_argument(
        "--batch-size",
        type=int_in(
            1, DIGITS_TRAIN_SIZE, f"the digits set has {DIGITS_TRAIN_SIZE:,} training images"
        ),
        default=64,
        help=f"global batch, split across ranks (64; at most {DIGITS_TRAIN_SIZE:,}, the data)",
    )
    p.add_argument(
        "--hidden",
        type=int_in(1, MAX_HIDDEN, "a wider MLP needs gigabytes per rank"),
        help=f"MLP hidden width (128; at most {MAX_HIDDEN}; a resumed run takes the checkpoint's)",
    )
    p.add_argument("--overlap", action="store_true", help="run the ZeRO step inside DDP's backward")
    p.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="after every epoch, write a sharded checkpoint (a directory; each rank writes its "
        "share) here, atomically; --impl torch writes one consolidated file",
    )
    p.add_argument(
        "--save-every",
        type=int_in(1, 1 << 40, ""),
        metavar="K",
        help="with --checkpoint, also save after every K steps (a restarted elastic torchrun "
        "job resumes from the last complete one)",
    )
    p.add_argument(
        "--grace-s",
        type=positive_float(MAX_TIMEOUT_S, "a week"),
        default=DEFAULT_GRACE_S,
        metavar="S",
        help=f"with --checkpoint, SIGTERM stops every rank after the same step and saves there "
        f"within S seconds ({DEFAULT_GRACE_S:g}), else exits without it; exit code 143",
    )
    p.add_argument(
        "--resume",
        metavar="PATH",
        help="continue from this checkpoint (a sharded directory, or an older single file), at "
        "any --nproc",
    )
    p.add_argument(
        "--impl",
        choices=("zero_functional", "torch"),
        default="zero_functional",
        help="whose ZeroRedundancyOptimizer: ours (default) or torch.distributed.optim's",
    )
    p.add_argument(
        "--no-reference", action="store_true", help="skip the plain DDP + Adam comparison run"
    )
    p.add_argument(
        "--bucket-cap-mb",
        type=positive_float(MAX_BUCKET_CAP_MB, "1 TiB"),
        default=25.0,
        help="DDP bucket size in MB (25); with --overlap, ranks own whole buckets",
    )
    p.add_argument(
        "--partition",
        choices=("flat", "sorted-greedy"),
        default="flat",
        help="who owns what: flat (even split, a tensor may straddle ranks; default) or "
        "sorted-greedy (torch's whole tensors)",
    )
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="the model's dtype (fp32); bf16: the reference's Adam state is bf16 too",
    )
    p.add_argument(
        "--main-params",
        choices=("fp32",),
        help="with --dtype bf16: ours with main_params_dtype=torch.float32 (fp32 main copies of "
        "the owned pieces, fp32 state); the reference's Adam on fp32 main weights",
    )
    p.add_argument(
        "--shard-size",
        type=int_in(1, MAX_LOCAL_RANKS, "gloo ranks on this one machine"),
        metavar="S",
        help="hybrid sharding: state sharded within groups of S ranks (a node) and replicated "
        "across the world/S groups (device_mesh=); S must divide --nproc (default: the world)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--timeout",
        type=positive_float(MAX_TIMEOUT_S, "a week"),
        default=600.0,
        help="seconds before a hang fails (600; at most a week)",
    )


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
    _add_train_flags(train, epochs=10)
    train.set_defaults(func=_cmd_train)
    demo = sub.add_parser("demo", help="what `make demo` runs: a short train, then a plan")
    _add_train_flags(demo, epochs=20)
    demo.set_defaults(func=_cmd_demo)
    add_plan_parser(sub)
    bench = sub.add_parser(
        "bench", help="run benchmarks/bench_*.py and print one table of ratios against torch's best"
    )
    bench.add_argument("--list", action="store_true", help="only list the scripts")
    bench.add_argument(
        "--quick", action="store_true", help="2 ranks, 3 rounds, 2M parameters (a smoke run)"
    )
    bench.add_argument(
        "--world-sizes",
        type=local_ranks,
        nargs="+",
        help=f"(scripts: 2 4; at most {MAX_LOCAL_RANKS}, ranks on this machine)",
    )
    bench.add_argument(
        "--rounds",
        type=int_in(1, MAX_BENCH_ROUNDS, "more do not move a median"),
        help=f"timed rounds per variant (at most {MAX_BENCH_ROUNDS:,})",
    )
    bench.add_argument(
        "--numel",
        type=int_in(1, MAX_BENCH_NUMEL, "4 GB per fp32 copy, several per rank"),
        help=f"model parameters (8,000,000; at most {MAX_BENCH_NUMEL:,})",
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
    code: int = args.func(args)
    return code
