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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from zero_functional import __version__
from zero_functional.app.plan_format import (
    DTYPE_BYTES,
    check_ranks,
    format_hybrid,
    format_memory,
    format_muon,
    format_plan,
)

__all__ = ["DTYPE_BYTES", "build_parser", "format_bench", "format_memory", "format_plan", "main"]

DEMO_WORLD_SIZES = (2, 8, 64)


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block), still with exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _fail(command: str, message: str) -> int:
    one_line = " ".join(message.split())
    print(f"zero-functional {command}: error: {one_line}", file=sys.stderr)
    return 2


MAX_LOCAL_RANKS = 64
"""Most ranks ``train``, ``demo`` and ``bench`` start: gloo processes on this one machine."""
MAX_PLAN_WORLD_SIZE = 1 << 20
"""Most ranks ``plan`` reports (past the largest clusters; 2**20 takes seconds and 0.6 GB)."""
MAX_SIMULATED_RANKS = 64
"""Most ranks ``plan --simulate`` builds per world size (each takes up to a second)."""
MAX_EPOCHS = 1_000_000
"""Most epochs of the train job: 23 million steps at the default batch, days of training."""
MAX_HIDDEN = 4096
"""Widest MLP of the train job: 17M parameters, about 0.5 GB per rank with the reference run."""
DIGITS_TRAIN_SIZE = 1438
"""The train job's training images (scikit-learn's 1,797 digits less the fixed 20% test split):
the largest global batch, as ``test_train.py`` checks against the data."""
SEED_RANGE = (-(2**63), 2**64 - 1)
"""``torch.manual_seed``'s range (it raises outside it)."""
MAX_BUCKET_CAP_MB = float(1 << 20)
"""1 TiB: past any model on one machine (DDP takes the cap in bytes as an int64)."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""A week (the launcher's waits take at most 2**31 ms, 24.8 days)."""
MAX_BENCH_ROUNDS = 10_000
MAX_BENCH_NUMEL = 1_000_000_000
"""4 GB per fp32 copy of the benchmarks' model, of which each rank holds several."""


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:37] + "...")


def _int_in(low: int, high: int, why: str, span: str = "") -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high``; the error says why the bound."""
    span = span or f"from {low:,} to {high:,}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # not an integer, or more digits than int() takes
            raise argparse.ArgumentTypeError(
                f"expected an integer {span}, got {_shown(text)}"
            ) from None
        if not low <= value <= high:
            reason = f" ({why})" if why and value > high else ""
            raise argparse.ArgumentTypeError(
                f"expected an integer {span}{reason}, got {_shown(text)}"
            )
        return value

    return parse


def _positive_float(high: float, why: str) -> Callable[[str], float]:
    """An argparse type: a finite number above 0 and at most ``high``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a positive number, got {_shown(text)}"
            ) from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected a positive number, got {_shown(text)}")
        if value > high:
            raise argparse.ArgumentTypeError(
                f"expected a positive number up to {high:,.0f} ({why}), got {_shown(text)}"
            )
        return value

    return parse


_ranks = _int_in(1, MAX_LOCAL_RANKS, "gloo ranks on this one machine")


def _rank_list(text: str) -> list[int]:
    """An argparse type: ranks separated by commas (``0,1023``), each an integer >= 0."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in parts) or len(parts) > MAX_SIMULATED_RANKS:
        raise argparse.ArgumentTypeError(
            f"expected up to {MAX_SIMULATED_RANKS} ranks (integers >= 0) separated by commas, "
            f"such as 0,1023, got {_shown(text)}"
        )
    return [int(part) for part in parts]


# ----------------------------------------------------------------------------- plan


def _current_directory_on_path() -> None:
    """Put the current directory first on ``sys.path``, as ``python -m`` does.

    The ``zero-functional`` script's own ``sys.path[0]`` is the folder of the script (the
    environment's ``bin``), so without this ``plan mymodels:build`` would not find
    ``./mymodels.py``, which ``python -m zero_functional plan mymodels:build`` finds.
    """
    here = os.getcwd()
    if not any(os.path.abspath(p or os.curdir) == here for p in sys.path):
        sys.path.insert(0, here)


def _cmd_plan(args: argparse.Namespace) -> int:
    from zero_functional.app.models import MODELS, model_shapes, muon_params, numels

    if args.model not in MODELS:
        _current_directory_on_path()
    try:
        shapes, muon = muon_params(args.model) if args.muon else (model_shapes(args.model), [])
    except ValueError as e:
        return _fail("plan", str(e))
    if not shapes:
        return _fail("plan", f"model {args.model!r} has no parameters; nothing to partition")
    if args.muon and not any(muon):
        return _fail(
            "plan",
            f"--muon: model {args.model!r} has no hidden 2-D matrix for Muon (torch.optim.Muon "
            "takes 2-D parameters only; embeddings and heads go to AdamW): drop --muon",
        )
    if args.shard_size is not None:
        from zero_functional.core.partition import hybrid_shape

        try:
            for w in args.world_sizes:
                hybrid_shape(w, args.shard_size)
        except ValueError as e:
            return _fail("plan", f"--shard-size: {e} (--world-sizes)")
    params = None
    if args.simulate is not None:
        try:
            check_ranks(args.simulate, args.world_sizes)  # before torch is imported
            from zero_functional.app.simulate import model_params

            params = model_params(shapes, args.dtype or "fp32")
        except ValueError as e:
            return _fail("plan", f"--simulate: {e}")
    dtype = args.dtype or "fp32"
    print(format_plan(args.model, numels(shapes), args.world_sizes))
    if args.dtype is not None or args.main_params is not None:
        print()
        print(format_memory(numels(shapes), args.world_sizes, dtype, args.main_params))
    if args.shard_size is not None:
        print()
        print(
            format_hybrid(
                numels(shapes), args.world_sizes, args.shard_size, dtype, args.main_params
            )
        )
    if params is not None:
        from zero_functional.app.simulate import format_simulated, simulate_ranks

        has_main = args.main_params is not None and DTYPE_BYTES[dtype] < 4
        rows = simulate_ranks(params, args.world_sizes, args.simulate, args.shard_size, has_main)
        print()
        print(format_simulated(rows))
    if args.muon:
        print()
        print(format_muon(shapes, muon, args.world_sizes))
    return 0


# ----------------------------------------------------------------------------- train / demo


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


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
    missing = _missing_modules(DEMO_MODULES)
    if missing:
        return None, _fail(
            command,
            f"the train job needs {' and '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed: "
            "pip install 'zero_functional[demo]'",
        )
    if args.batch_size < args.nproc:
        return None, _fail(
            command, f"--batch-size {args.batch_size} is smaller than --nproc {args.nproc}"
        )
    if args.overlap and args.impl == "torch":
        return None, _fail(
            command,
            "--overlap with --impl torch hangs on gloo (pytorch#62300); drop one of the two",
        )
    if args.main_params and args.impl == "torch":
        return None, _fail(
            command,
            "--main-params fp32 needs --impl zero_functional: torch's ZeroRedundancyOptimizer "
            "keeps no main copy",
        )
    if args.shard_size is not None:
        if args.impl == "torch":
            return None, _fail(
                command,
                "--shard-size needs --impl zero_functional: torch's ZeroRedundancyOptimizer "
                "takes no device mesh",
            )
        from zero_functional.core.partition import hybrid_shape

        world = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else args.nproc
        try:
            hybrid_shape(world, args.shard_size)
        except ValueError as e:
            where = "torchrun's WORLD_SIZE" if _under_torchrun() else "--nproc"
            return None, _fail(command, f"--shard-size: {e} ({where})")
    if args.main_params and args.dtype == "fp32":
        return None, _fail(
            command,
            "--main-params fp32 with --dtype fp32: fp32 parameters need no main copy; "
            "pass --dtype bf16",
        )
    if args.dtype != "fp32" and (args.checkpoint or args.resume):
        return None, _fail(
            command,
            f"--dtype {args.dtype} with --checkpoint/--resume is not supported yet; "
            "checkpoint an fp32 run",
        )
    if args.checkpoint is not None:
        parent = Path(args.checkpoint).resolve().parent
        if not parent.is_dir():
            return None, _fail(command, f"--checkpoint directory {parent} does not exist")
        # ours writes a sharded checkpoint (a directory); torch's class, one consolidated file
        sharded = args.impl == "zero_functional"
        if sharded and Path(args.checkpoint).is_file():
            return None, _fail(
                command,
                f"--checkpoint {args.checkpoint} is a file (a single-file checkpoint); a sharded "
                "checkpoint is a directory: pass a new path",
            )
        if not sharded and Path(args.checkpoint).is_dir():
            return None, _fail(
                command,
                f"--checkpoint {args.checkpoint} is a directory; --impl torch writes one "
                "consolidated file: pass a file path",
            )
        why = _unwritable_directory(parent)
        if why is not None:
            return None, _fail(
                command,
                f"--checkpoint {args.checkpoint}: cannot create files in {parent} ({why}); "
                "pass a path in a writable directory",
            )
    if args.overlap:
        try:
            import zero_functional.hooks  # noqa: F401
        except ImportError as e:
            return None, _fail(command, f"--overlap needs zero_functional.hooks, which fails: {e}")
    from zero_functional.app.train import CheckpointError, TrainConfig, load_checkpoint

    hidden: int | None = args.hidden
    if args.resume is not None:
        try:
            ckpt = load_checkpoint(args.resume)
        except CheckpointError as e:
            return None, _fail(command, str(e))
        if int(ckpt["epoch"]) >= args.epochs:
            return None, _fail(
                command,
                f"checkpoint {args.resume} has finished epoch {ckpt['epoch']} of --epochs "
                f"{args.epochs}; pass --epochs {int(ckpt['epoch']) + 1} or more to continue",
            )
        saved = int(ckpt["args"]["hidden"])
        if hidden is not None and hidden != saved:
            return None, _fail(
                command,
                f"--hidden {hidden} conflicts with checkpoint {args.resume}, whose model has "
                f"hidden {saved}; drop --hidden (a resumed run takes the checkpoint's)",
            )
        hidden = saved
    if args.impl == "zero_functional":
        try:
            import zero_functional.optimizer  # noqa: F401
        except ImportError as e:
            return None, _fail(
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
        )
    except ValueError as e:
        return None, _fail(command, str(e))
    return cfg, 0


def _cmd_train(args: argparse.Namespace) -> int:
    cfg, code = _train_config(args, args.command)
    if code:
        return code
    from zero_functional.app.train import TrainConfig, launch, run_torchrun

    assert isinstance(cfg, TrainConfig)
    if _under_torchrun():
        return run_torchrun(cfg)
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
    code = _cmd_plan(build_parser().parse_args(plan_argv))
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


def _cmd_bench(args: argparse.Namespace) -> int:
    bench_dir = Path(args.dir) if args.dir else _benchmarks_dir()
    scripts = sorted(p for p in bench_dir.glob("bench_*.py")) if bench_dir.is_dir() else []
    if not scripts:
        return _fail(
            "bench",
            f"no benchmarks/bench_*.py under {bench_dir}; run from a source checkout or pass --dir",
        )
    if args.list:
        print("\n".join(str(s) for s in scripts))
        return 0
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
        "--nproc", type=_ranks, default=2, help=f"local ranks to spawn (2; 1 to {MAX_LOCAL_RANKS})"
    )
    p.add_argument(
        "--epochs",
        type=_int_in(1, MAX_EPOCHS, "a million epochs already take days"),
        default=epochs,
        help=f"epochs ({epochs}; at most {MAX_EPOCHS:,})",
    )
    p.add_argument(
        "--lr",
        type=_positive_float(math.inf, ""),
        default=1e-3,
        help="Adam learning rate (1e-3)",
    )
    p.add_argument(
        "--seed",
        type=_int_in(*SEED_RANGE, "", span="in torch.manual_seed's range, -2**63 to 2**64-1"),
        default=0,
        help="init and data-order seed (0; -2**63 to 2**64-1, torch.manual_seed's range)",
    )
    p.add_argument(
        "--batch-size",
        type=_int_in(
            1, DIGITS_TRAIN_SIZE, f"the digits set has {DIGITS_TRAIN_SIZE:,} training images"
        ),
        default=64,
        help=f"global batch, split across ranks (64; at most {DIGITS_TRAIN_SIZE:,}, the data)",
    )
    p.add_argument(
        "--hidden",
        type=_int_in(1, MAX_HIDDEN, "a wider MLP needs gigabytes per rank"),
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
        type=_positive_float(MAX_BUCKET_CAP_MB, "1 TiB"),
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
        type=_int_in(1, MAX_LOCAL_RANKS, "gloo ranks on this one machine"),
        metavar="S",
        help="hybrid sharding: state sharded within groups of S ranks (a node) and replicated "
        "across the world/S groups (device_mesh=); S must divide --nproc (default: the world)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--timeout",
        type=_positive_float(MAX_TIMEOUT_S, "a week"),
        default=600.0,
        help="seconds before a hang fails (600; at most a week)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``zero-functional`` (for ``--help`` and the tests)."""
    parser = _Parser(
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
        description="Spawns --nproc gloo ranks on 127.0.0.1, or joins torchrun's group.",
    )
    _add_train_flags(train, epochs=10)
    train.set_defaults(func=_cmd_train)
    demo = sub.add_parser("demo", help="what `make demo` runs: a short train, then a plan")
    _add_train_flags(demo, epochs=20)
    demo.set_defaults(func=_cmd_demo)
    plan = sub.add_parser(
        "plan",
        help="balance of sorted-greedy and flat partitions for a model (pure, instant)",
        description="MODEL: a built-in spec or module:function returning an nn.Module "
        "(built on the meta device).",
    )
    from zero_functional.app.models import MODELS

    plan.add_argument("model", metavar="MODEL", help=f"{', '.join(MODELS)}, or module:function")
    plan.add_argument(
        "--world-sizes",
        type=_int_in(1, MAX_PLAN_WORLD_SIZE, "2**20 ranks is more than any cluster has"),
        nargs="+",
        default=list(DEMO_WORLD_SIZES),
        help=f"world sizes to report (2 8 64; at most {MAX_PLAN_WORLD_SIZE:,})",
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
    plan.add_argument(
        "--shard-size",
        type=_int_in(1, MAX_PLAN_WORLD_SIZE, "2**20 ranks is more than any cluster has"),
        metavar="S",
        help="also print hybrid sharding (state sharded within groups of S ranks, a node, and "
        "replicated across world/S): state per rank and bytes per rank and step within and "
        "across nodes; S must divide every world size",
    )
    plan.add_argument(
        "--simulate",
        type=_rank_list,
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
    plan.set_defaults(func=_cmd_plan)
    bench = sub.add_parser(
        "bench", help="run benchmarks/bench_*.py and print one table of ratios against torch's best"
    )
    bench.add_argument("--list", action="store_true", help="only list the scripts")
    bench.add_argument(
        "--quick", action="store_true", help="2 ranks, 3 rounds, 2M parameters (a smoke run)"
    )
    bench.add_argument(
        "--world-sizes",
        type=_ranks,
        nargs="+",
        help=f"(scripts: 2 4; at most {MAX_LOCAL_RANKS}, ranks on this machine)",
    )
    bench.add_argument(
        "--rounds",
        type=_int_in(1, MAX_BENCH_ROUNDS, "more do not move a median"),
        help=f"timed rounds per variant (at most {MAX_BENCH_ROUNDS:,})",
    )
    bench.add_argument(
        "--numel",
        type=_int_in(1, MAX_BENCH_NUMEL, "4 GB per fp32 copy, several per rank"),
        help=f"model parameters (8,000,000; at most {MAX_BENCH_NUMEL:,})",
    )
    bench.add_argument("--dir", help="the benchmarks directory (default: the checkout's)")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``zero-functional`` with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code
