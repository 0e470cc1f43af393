"""``zero-functional plan``: its flags and what it does (pure, instant: no process starts). The
tables are :mod:`.plan_format`'s, the simulation :mod:`.simulate`'s.

Example:
    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> add_plan_parser(parser.add_subparsers())
    >>> parser.parse_args(["plan", "gpt2-small", "--simulate", "0, 1023"]).simulate
    [0, 1023]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from zero_functional.app.cli_args import IntIn, fail, shown
from zero_functional.app.models import MODELS, model_shapes, muon_params, numels
from zero_functional.app.plan_format import (
    DTYPE_BYTES,
    format_hybrid,
    format_memory,
    format_muon,
    format_plan,
)
from zero_functional.core.loads import hybrid_shape

DEMO_WORLD_SIZES = (2, 8, 64)  # the world sizes ``plan`` reports by default, and the demo's plan
MAX_SIMULATED_RANKS = 64
"""Most ranks ``plan --simulate`` builds per world size (each takes up to a second)."""
world_sizes = IntIn(1, 1 << 20, "2**20 ranks is more than any cluster has")


def rank_list(text: str) -> list[int]:
    """An argparse type: ranks separated by commas (``0,1023``), each an integer >= 0."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in parts) or len(parts) > MAX_SIMULATED_RANKS:
        raise argparse.ArgumentTypeError(
            f"expected up to {MAX_SIMULATED_RANKS} ranks (integers >= 0) separated by commas, "
            f"such as 0,1023, got {shown(text)}"
        )
    return [int(part) for part in parts]


def cmd_plan(args: argparse.Namespace) -> int:
    here = os.getcwd()  # first on sys.path, as python -m has it (the script's is its bin/)
    if args.model not in MODELS and all(os.path.abspath(p or ".") != here for p in sys.path):
        sys.path.insert(0, here)
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
            for w in args.world_sizes:
                hybrid_shape(w, args.shard_size)
        except ValueError as e:
            return fail("plan", f"--shard-size: {e} (--world-sizes)")
    params = None
    if args.simulate is not None:
        bad = [(r, w) for w in args.world_sizes for r in args.simulate if not 0 <= r < w]
        if bad:  # before torch is imported
            r, w = bad[0]
            return fail(
                "plan",
                f"--simulate: rank {r} is not a rank of world size {w}: pass ranks from 0 to {w - 1}",
            )
        from zero_functional.app.simulate import model_params

        try:
            params = model_params(shapes, args.dtype or "fp32")
        except ValueError as e:
            return fail("plan", f"--simulate: {e}")
    n, dtype = numels(shapes), args.dtype or "fp32"
    print(format_plan(args.model, n, args.world_sizes))
    if args.dtype or args.main_params or args.optimizer or args.remainders or args.ema:
        optimizer = args.optimizer or "adamw"
        m = format_memory(
            n, args.world_sizes, dtype, args.main_params, optimizer, args.remainders, args.ema
        )
        print(f"\n{m}")
    if args.shard_size is not None:
        print(f"\n{format_hybrid(n, args.world_sizes, args.shard_size, dtype, args.main_params)}")
    if params is not None:
        from zero_functional.app.simulate import format_simulated, simulate

        main = args.main_params is not None and DTYPE_BYTES[dtype] < 4
        rows = [
            simulate(
                params, w, r, partition=partition, shard_size=args.shard_size, main_params=main
            )
            for w in args.world_sizes
            for r in args.simulate
            for partition in ("sorted_greedy", "flat")
        ]
        print(f"\n{format_simulated(rows)}")
    if args.muon:
        print(f"\n{format_muon(shapes, muon, args.world_sizes)}")
    return 0


def add_plan_parser(sub: Any) -> None:
    """Add the ``plan`` command to ``sub`` (an ``add_subparsers()`` object)."""
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
    plan.set_defaults(func=cmd_plan)
