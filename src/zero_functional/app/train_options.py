"""The train job's options, declared once: each field of :class:`TrainConfig` carries its flag,
default, bounds, help and the flags it needs; :func:`add_flags` makes ``train``'s and ``demo``'s
flags from them and :func:`train_config` the checked config, before any rank starts. A flag's
errors answer without importing torch.

Example:
    >>> TrainConfig(save_every=5)
    Traceback (most recent call last):
    ...
    ValueError: --save-every needs --checkpoint: it saves there
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from zero_functional.app.cli_args import IntIn, PositiveFloat, local_ranks
from zero_functional.app.cluster import ClusterRank
from zero_functional.app.preempt import DEFAULT_GRACE_S

DIGITS_TRAIN_SIZE = 1438  # scikit-learn's 1,797 digits less the 20% test split: the largest batch
DEMO_MODULES = {"sklearn": "scikit-learn", "tqdm": "tqdm"}  # the job's imports beyond torch
OURS = "zero_functional"
NODE_LOCAL = frozenset({"snapshot_dir"})
"""Options each node may set for itself (its memory's directory): left out of a checkpoint's
``args``, which every rank writes and which must then be the same on every rank."""

T = TypeVar("T")


class Needs(NamedTuple):
    """An option, when set, needs ``field`` set (``value`` None) or equal to ``value``."""

    field: str
    value: str | None
    why: str


def option(
    default: T,
    help: str,
    type: IntIn | PositiveFloat | None = None,
    *,
    choices: tuple[str, ...] = (),
    needs: tuple[Needs, ...] = (),
    metavar: str | None = None,
) -> T:
    """A field of :class:`TrainConfig` with its flag's facts: ``help`` (for a ``True`` default,
    what ``--no-<name>`` does), its argparse ``type`` (the bounds), ``choices``, ``needs``."""
    facts = {"help": help, "type": type, "choices": choices, "needs": needs, "metavar": metavar}
    return field(default=default, metadata=facts)


TORCH = "torch's ZeroRedundancyOptimizer"
FP32 = Needs("dtype", "fp32", "checkpoints of a bf16 model are not supported yet")
EPOCHS = IntIn(1, 1_000_000, "a million epochs already take days")
SEEDS = IntIn(
    -(2**63), 2**64 - 1, span="in torch.manual_seed's range, -2**63 to 2**64-1", hard=True
)
BATCHES = IntIn(1, DIGITS_TRAIN_SIZE, f"the digits set has {DIGITS_TRAIN_SIZE:,} training images")
WIDTHS = IntIn(1, 4096, "a wider MLP needs gigabytes per rank")
A_WEEK = PositiveFloat(7 * 24 * 3600.0, "a week")  # the launcher waits at most 2**31 ms


@dataclass(frozen=True)
class TrainConfig:
    """Everything the train job takes; picklable, so it travels to spawned ranks. A field's
    flag is its name with dashes (``--batch-size``), ``--no-<name>`` for a ``True`` default;
    whoever builds the config, it checks itself against the bounds and needs declared here.
    """

    nproc: int = option(2, "local ranks to spawn", local_ranks)
    epochs: int = option(10, "epochs; a resumed run continues up to this many", EPOCHS)
    lr: float = option(1e-3, "Adam's learning rate", PositiveFloat())
    seed: int = option(0, "init and data-order seed", SEEDS)
    batch_size: int = option(64, "global batch, split across ranks", BATCHES)
    hidden: int = option(128, "MLP hidden width; a resumed run takes the checkpoint's", WIDTHS)
    overlap: bool = option(
        False,
        "run the ZeRO step inside DDP's backward",
        needs=(Needs("impl", OURS, "torch's overlap mode hangs on gloo (pytorch#62300)"),),
    )
    checkpoint: str | None = option(
        None,
        "after every epoch, save here atomically: a directory each rank writes its share of "
        "(--impl torch: one file)",
        metavar="PATH",
        needs=(FP32,),
    )
    save_every: int | None = option(
        None,
        "save after every K steps instead of every epoch (where a restarted elastic torchrun "
        "job resumes); the end of training always saves",
        IntIn(1, 1 << 40),
        metavar="K",
        needs=(Needs("checkpoint", None, "it saves there"),),
    )
    snapshot_every: int | None = option(
        None,
        "after every K steps keep an in-memory snapshot, each rank's share on its node and a "
        "copy on the next node; a worker torchrun restarts resumes from the newest complete one",
        IntIn(1, 1 << 40),
        metavar="K",
        needs=(FP32, Needs("impl", OURS, f"{TORCH} keeps no shares")),
    )
    snapshot_dir: str | None = option(
        None,
        "each node's snapshot directory (default: /dev/shm/zero_functional-<run id>, the run id "
        "torchrun's --rdzv-id or SLURM's job id)",
        metavar="DIR",
        needs=(Needs("snapshot_every", None, "it keeps the snapshots there"),),
    )
    grace_s: float = option(
        DEFAULT_GRACE_S,
        "on SIGTERM every rank stops after the same step and saves there within S seconds "
        "(else exits without it); exit code 143",
        A_WEEK,
        metavar="S",
        needs=(Needs("checkpoint", None, "SIGTERM saves there, within S seconds"),),
    )
    resume: str | None = option(
        None, "continue from this checkpoint, at any --nproc", metavar="PATH", needs=(FP32,)
    )
    impl: str = option(OURS, "whose ZeroRedundancyOptimizer", choices=(OURS, "torch"))
    reference: bool = option(True, "skip the plain DDP + Adam comparison run")
    bucket_cap_mb: float = option(
        25.0,
        "DDP's bucket size in MB (overlap mode: what a rank owns)",
        PositiveFloat(2.0**20, "1 TiB"),
    )
    partition: str = option(
        "flat", "an even split, or torch's whole tensors", choices=("flat", "sorted-greedy")
    )
    dtype: str = option("fp32", "the model's dtype", choices=("fp32", "bf16"))
    main_params: str | None = option(
        None,
        "fp32 main copies and state of the owned pieces (the reference: Adam on fp32 copies)",
        choices=("fp32",),
        needs=(
            Needs("dtype", "bf16", "fp32 parameters need no main copy"),
            Needs("impl", OURS, f"{TORCH} keeps no main copy"),
        ),
    )
    wire_dtype: str | None = option(
        None,
        "gradients cross to their owners in this format, rounded once, summed in fp32",
        choices=("bf16", "fp16", "int8", "fp8"),
        needs=(Needs("impl", OURS, f"{TORCH} sends the gradients' dtype"),),
    )
    gather_dtype: str | None = option(
        None,
        "parameters' changes cross in this format from fp32 main copies (every rank adds them)",
        choices=("bf16", "fp16", "int8", "fp8"),
        needs=(Needs("impl", OURS, f"{TORCH} sends the parameters' values"),),
    )
    shard_size: int | None = option(
        None,
        "hybrid sharding: state sharded in groups of S ranks, replicated across the groups",
        local_ranks,
        metavar="S",
        needs=(Needs("impl", OURS, f"{TORCH} takes no device mesh"),),
    )
    progress: bool = option(True, "no progress bar")
    timeout: float = option(600.0, "seconds before a hang fails", A_WEEK)

    def __post_init__(self) -> None:
        for f in fields(self):
            value, facts = getattr(self, f.name), f.metadata
            try:
                if value is not None and facts["type"] is not None:
                    facts["type"](str(value), cap=False)  # the command line's caps aside
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"{_flag(f.name)}: {e}") from None
            if value is not None and facts["choices"] and value not in _values(f):
                raise ValueError(f"{_flag(f.name)}: expected one of {_values(f)}, got {value!r}")
            for need in facts["needs"] if value != f.default else ():
                have = getattr(self, need.field)
                if have is None if need.value is None else have != need.value:
                    shown = f" {value}" if facts["choices"] else ""
                    to = f" {need.value}" if need.value else ""
                    raise ValueError(
                        f"{_flag(f.name)}{shown} needs {_flag(need.field)}{to}: {need.why}"
                    )
        if self.snapshot_every is not None and self.shard_size is not None:
            raise ValueError(
                "--snapshot-every does not take --shard-size: the replicas of a mesh hold the "
                "same share; save with --checkpoint"
            )
        if self.batch_size < self.nproc:
            raise ValueError(f"--batch-size {self.batch_size} is smaller than --nproc {self.nproc}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _values(f: Field[Any]) -> tuple[str, ...]:
    """The values of a field with choices: its flag's choices as identifiers."""
    return tuple(c.replace("-", "_") for c in f.metadata["choices"])


def add_flags(parser: argparse.ArgumentParser, **defaults: object) -> None:
    """Add :class:`TrainConfig`'s flags to ``parser``, ``defaults`` overriding some fields'
    defaults (the demo's epochs). An absent flag parses to None: :func:`train_config` knows
    what was given."""
    for f in fields(TrainConfig):
        facts, default = f.metadata, defaults.get(f.name, f.default)
        if isinstance(default, bool):
            flag = _flag(f"no_{f.name}" if default else f.name)
            action = "store_false" if default else "store_true"
            parser.add_argument(flag, dest=f.name, action=action, default=None, help=facts["help"])
            continue
        shown = f"{default:g}" if isinstance(default, float) else default
        hint = "; ".join(str(x) for x in (shown, facts["type"]) if x is not None)
        parser.add_argument(
            _flag(f.name),
            type=facts["type"],
            choices=facts["choices"] or None,
            metavar=facts["metavar"],
            help=f"{facts['help']} ({hint})" if hint else facts["help"],
        )
    parser.set_defaults(train_defaults=defaults)


def train_config(
    args: argparse.Namespace, where: ClusterRank | None, load: Callable[[str], Mapping[str, Any]]
) -> TrainConfig:
    """The config ``args`` give, after every check a parent can make: the flags (no torch),
    the ``demo`` extra, the world, the checkpoint's path, then the checkpoint ``load`` reads.

    Raises:
        ValueError: Which flag, and the fix, in one line.
    """
    given = {
        f.name: value.replace("-", "_") if f.metadata["choices"] else value
        for f in fields(TrainConfig)
        if (value := getattr(args, f.name)) is not None
    }
    cfg = TrainConfig(**{**args.train_defaults, **given})
    if missing := [d for m, d in DEMO_MODULES.items() if not _findable(m)]:
        are = "is" if len(missing) == 1 else "are"
        raise ValueError(
            f"the train job needs {' and '.join(missing)}, which {are} not installed: "
            "pip install 'zero_functional[demo]'"
        )
    if cfg.shard_size is not None:
        from zero_functional.core.loads import hybrid_shape

        try:
            hybrid_shape(where.world_size if where else cfg.nproc, cfg.shard_size)
        except ValueError as e:
            whose = f"{where.source}'s world size" if where else "--nproc"
            raise ValueError(f"--shard-size: {e} ({whose})") from None
    if cfg.checkpoint is not None:
        _check_checkpoint_path(cfg.checkpoint, sharded=cfg.impl == OURS)
    if cfg.snapshot_every is not None and cfg.snapshot_dir is None:
        from zero_functional.checkpoint.snapshots import default_snapshot_dir

        try:  # every rank, and its restarts, agree on it
            cfg = replace(cfg, snapshot_dir=default_snapshot_dir())
        except ValueError:
            raise ValueError(
                "--snapshot-every needs --snapshot-dir here: the default, /dev/shm/"
                "zero_functional-<run id>, takes the run id from torchrun (--rdzv-id) or SLURM"
            ) from None
    for module, needed, fix in (
        ("zero_functional.hooks", cfg.overlap, "--overlap needs it"),
        ("zero_functional.optimizer", cfg.impl == OURS, "try --impl torch"),
    ):
        try:
            if needed:
                importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"{module} does not import ({e}); {fix}") from e
    if cfg.resume is None:
        return cfg
    ckpt = load(cfg.resume)
    done, hidden = int(ckpt["epoch"]), int(ckpt["args"]["hidden"])
    if done >= cfg.epochs:
        raise ValueError(
            f"checkpoint {cfg.resume} has finished epoch {done} of --epochs {cfg.epochs}; pass "
            f"--epochs {done + 1} or more to continue"
        )
    if given.get("hidden", hidden) != hidden:
        raise ValueError(
            f"--hidden {cfg.hidden} conflicts with checkpoint {cfg.resume}, whose model has hidden "
            f"{hidden}; drop --hidden (a resumed run takes the checkpoint's)"
        )
    return replace(cfg, hidden=hidden)


def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _check_checkpoint_path(path: str, sharded: bool) -> None:
    """Refuse a ``--checkpoint`` that cannot be written: ours writes a directory (``sharded``),
    torch's class one consolidated file."""
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise ValueError(f"--checkpoint directory {parent} does not exist")
    if sharded and Path(path).is_file():
        raise ValueError(
            f"--checkpoint {path} is a file (a single-file checkpoint); a sharded checkpoint is a "
            "directory: pass a new path"
        )
    if not sharded and Path(path).is_dir():
        raise ValueError(
            f"--checkpoint {path} is a directory; --impl torch writes one consolidated file: "
            "pass a file path"
        )
    try:
        with tempfile.TemporaryFile(dir=parent):  # on Linux an O_TMPFILE: never named
            pass
    except OSError as e:
        raise ValueError(
            f"--checkpoint {path}: cannot create files in {parent} "
            f"({e.strerror or type(e).__name__}); pass a path in a writable directory"
        ) from None
