"""What the multi-process tests share: the small model, its batches, DDP's averaging by hand,
and the comparisons (one copy each, so the tests cannot drift apart)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from zero_functional.app import cli, launch

R = TypeVar("R")

ROOT = Path(__file__).resolve().parents[1]

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "zero_functional.optimizer",
    "torch.distributed.optim",
    "torch.distributed.checkpoint",
    "zero_functional.checkpoint",
    "pytest",
    "tests.forkserver_freeze",  # last: freezes what the ones before made
)
"""What the forkserver imports once, so that no rank imports it again: what the tests' own
modules import (a rank imports the module of its function; torch's ZeRO and DCP, 0.1-0.3 s of
CPU a rank); then :mod:`tests.forkserver_freeze`, so that a rank's
``gc.collect()`` does not copy the server's heap."""


def run_ranks(
    fn: Callable[..., R],
    world_size: int,
    *args: object,
    start_method: launch.StartMethod = "forkserver",
    **kwargs: Any,
) -> list[R]:
    """:func:`zero_functional.app.launch.run_ranks`, ranks forked from one server that has
    :data:`PRELOAD` imported: a launch takes about 0.2 s instead of 1.5-2 s for two spawned
    ranks that each import torch. A forked rank ends with ``os._exit``, not the interpreter's
    exit: the tests of how ranks exit (test_launch, test_teardown) spawn theirs. Ranks forked
    from this process (``start_method="fork"``) find its objects frozen, as the forkserver's
    are (:mod:`tests.forkserver_freeze`): what the test imported since collection (Lightning,
    Transformers), which tests/conftest.py froze the rest of."""
    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(list(PRELOAD))  # used when the server starts
    elif start_method == "fork":
        gc.freeze()
    return launch.run_ranks(fn, world_size, *args, start_method=start_method, **kwargs)


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Three linear layers (7 -> 13 -> 5 -> 3), seeded, in ``dtype``."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, 3))
    return model.to(dtype)


def global_batch(
    step: int, n: int = 12, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``step`` (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 7, generator=g, dtype=dtype), torch.randn(n, 3, generator=g, dtype=dtype)


def local_batch(
    rank: int, world_size: int, step: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's equal slice of :func:`global_batch`."""
    x, y = global_batch(step, dtype=dtype)
    per = x.shape[0] // world_size
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def local_backward(module: nn.Module, rank: int, world_size: int, step: int) -> torch.Tensor:
    """Backward of the mean squared error on this rank's slice of :func:`global_batch`, through
    ``module`` (a DDP averages the gradients itself, or its comm hook reduces them)."""
    x, y = local_batch(rank, world_size, step, next(module.parameters()).dtype)
    loss = ((module(x) - y) ** 2).mean()
    loss.backward()
    return loss.detach()


def averaged_backward(model: nn.Module, rank: int, world_size: int, step: int) -> torch.Tensor:
    """Backward on this rank's slice, then average the gradients as DDP does (equal slices)."""
    loss = local_backward(model, rank, world_size, step)
    average_grads(model, world_size)
    return loss


Backward = Callable[[nn.Module, int, int, int], object]
"""``backward(module, rank, world_size, step)``: one step's forward and backward."""


def train_both(
    pairs: Sequence[tuple[nn.Module, torch.optim.Optimizer | Sequence[torch.optim.Optimizer]]],
    rank: int,
    world_size: int,
    steps: int | Iterable[int],
    backward: Backward = averaged_backward,
    schedulers: Sequence[Any] = (),
) -> None:
    """Train each ``(module, optimizers)`` pair (ours and its references) on the same batches:
    per step (``steps`` of them, or these step numbers) and pair, ``zero_grad``, ``backward``,
    ``step``; then each of ``schedulers`` steps. An optimizer in overlap mode has stepped inside
    backward, so it is not stepped again; its all-gathers are finished at the end, so that the
    parameters can be compared."""
    groups = [(m, [o] if isinstance(o, torch.optim.Optimizer) else list(o)) for m, o in pairs]
    for step in range(steps) if isinstance(steps, int) else steps:
        for module, opts in groups:
            for o in opts:
                o.zero_grad()
            backward(module, rank, world_size, step)
            for o in opts:
                if not getattr(o, "overlap_with_ddp", False):
                    o.step()
        for s in schedulers:
            s.step()
    for _, opts in groups:
        for o in opts:
            if hasattr(o, "finish_param_sync"):
                o.finish_param_sync()


def average_(tensors: Iterable[torch.Tensor], world_size: int) -> None:
    """Average each tensor over the ranks in place, as DDP averages a gradient over equal
    slices: ``all_reduce`` (a sum) and then ``/= world_size``, in that order, tensor by tensor,
    so that a parity test against DDP or torch stays bitwise. Collective (default group)."""
    for t in tensors:
        dist.all_reduce(t)
        t /= world_size


def average_grads(params: nn.Module | Iterable[torch.Tensor], world_size: int) -> None:
    """:func:`average_` on the gradients of ``params`` (a module's parameters, or the tensors
    given); a parameter without a gradient is skipped. Collective (default group)."""
    ps = params.parameters() if isinstance(params, nn.Module) else params
    average_([p.grad for p in ps if p.grad is not None], world_size)


FUSED = {"fused": True}
"""For a reference Adam or AdamW: the kernel our functional core runs on the CPU. torch's fused
and foreach Adam are not the same arithmetic (they drift apart by up to 1e-6 in five steps at
lr 0.01, depending on the data), so a parity test with its reference on another kernel would
measure torch's two kernels, not our sharding."""


def ours_kernel(cls: type) -> dict[str, bool]:
    """:data:`FUSED` for ``torch.optim.Adam`` and ``AdamW``, nothing for other classes."""
    return FUSED if cls in (torch.optim.Adam, torch.optim.AdamW) else {}


def max_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest elementwise difference between two models' parameters (0 for empty ones)."""
    return max(
        (pa - pb).abs().max().item() if pa.numel() else 0.0
        for pa, pb in zip(a.parameters(), b.parameters())
    )


def consolidated(opt: Any, rank: int) -> dict[str, Any] | None:
    """``opt``'s full state dict, consolidated on rank 0 and sent to every rank; collective."""
    opt.consolidate_state_dict(to=0)
    sd = [opt.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(sd, src=0)
    return sd[0]


def run_script(script: str, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the repository's ``script`` (e.g. ``benchmarks/gpu_check.py``) with ``args`` in a fresh
    interpreter, from the repository root, ``src`` first on its path; its output as text."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p
    )
    return subprocess.run(
        [sys.executable, script, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def forked_train_ranks(monkeypatch: Any) -> None:
    """Make the train job started in this process (``cli.main(["train", ...])``) fork its ranks
    from the tests' forkserver (:func:`run_ranks`) instead of spawning fresh interpreters: the
    same job, about 2 s less per rank. How ranks exit is tested with spawned ranks elsewhere
    (test_launch, test_teardown, and ``train`` run as a subprocess)."""
    from zero_functional.app import train

    monkeypatch.setattr(train, "run_ranks", run_ranks)


def run_cli(argv: list[str], capsys: Any) -> tuple[int, str, str]:
    """``zero-functional ARGV`` through the script's own ``main``, in this process (``python -m``
    itself is run by test_readme's demo test): the exit code, whether ``main`` returns or
    exits, and what it printed to stdout and stderr (``capsys``, pytest's fixture)."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def reduced_grads(zero: Any, rank: int) -> list[torch.Tensor]:
    """The gradients this step reduced, whole on every rank: each rank's owned pieces of its
    ``.grad`` (the only elements that hold the average), the others zero, summed; collective."""
    full = [torch.zeros_like(p) for p in zero.param_table.params]
    for s in zero.ownership.owned(rank):
        grad = zero.param_table.params[s.param].grad
        assert grad is not None
        full[s.param].view(-1)[s.start : s.stop] = grad.reshape(-1)[s.start : s.stop]
    for t in full:
        dist.all_reduce(t)
    return full


def all_to_all_sent(input: torch.Tensor, input_splits: Iterable[int], group: Any = None) -> int:
    """Bytes this rank sends in ``dist.all_to_all_single(out, input, out_splits, input_splits,
    group=group)`` (gloo's reduce onto owners, ``comm.exchange``): every split but its own."""
    splits = list(input_splits)
    return (sum(splits) - splits[dist.get_rank(group)]) * input.element_size()


def flip_byte(directory: str | os.PathLike[str], offset: int) -> None:
    """Flip the bits of the byte at ``offset`` in the checkpoint data file (``.distcp``) in
    ``directory``: corruption that a checksum, not a size, finds."""
    data = next(f for f in sorted(os.listdir(directory)) if f.endswith(".distcp"))
    with open(os.path.join(directory, data), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
