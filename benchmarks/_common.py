"""What every benchmark shares: the model, the launcher, medians, and a byte counter.

The byte counter wraps ``torch.distributed``'s collectives in the calling process and converts
each call's buffer into the bytes one rank sends under ring algorithms
(:func:`zero_functional.plans.bytes_sent`), so the bytes columns are counted from what
actually ran, not computed from a formula.
"""

from __future__ import annotations

import contextlib
import inspect
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zero_functional.launch import run_ranks
from zero_functional.plans import bytes_sent

__all__ = ["ByteCounter", "median_ms", "mlp", "run_ranks"]

WIDTH = 1000


def mlp(numel: int, *, relu: bool = True) -> nn.Module:
    """``numel // 1e6`` layers of Linear(1000, 1000) (+ ReLU), seeded: the benchmark model."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(max(1, numel // (WIDTH * WIDTH))):
        layers.append(nn.Linear(WIDTH, WIDTH))
        if relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def median_ms(times_s: list[float]) -> float:
    return statistics.median(times_s) * 1e3


# (name, which argument is the buffer, how its size relates to the collective's S)
_OPS: dict[str, tuple[str, Callable[[Any, int], int]]] = {
    "all_reduce": ("all_reduce", lambda t, n: t.numel() * t.element_size()),
    "reduce": ("reduce", lambda t, n: t.numel() * t.element_size()),
    "broadcast": ("broadcast", lambda t, n: t.numel() * t.element_size()),
    "all_gather": ("all_gather", lambda t, n: n * t.numel() * t.element_size()),
    "all_gather_single": ("all_gather", lambda t, n: t.numel() * t.element_size()),
    "all_gather_into_tensor": ("all_gather", lambda t, n: t.numel() * t.element_size()),
    "reduce_scatter_single": ("reduce_scatter", lambda t, n: t.numel() * t.element_size()),
    "reduce_scatter_tensor": ("reduce_scatter", lambda t, n: t.numel() * t.element_size()),
}
# which positional argument holds S's tensor: the output of the gathers, the input of the scatters
_ARG = {"all_gather": 1, "all_gather_single": 0, "all_gather_into_tensor": 0}
_ARG.update({"reduce_scatter_single": 1, "reduce_scatter_tensor": 1})


class ByteCounter:
    """Counts the bytes this rank sends through ``torch.distributed`` collectives.

    ``with counter.counting(): ...`` wraps the collectives for the block; ``counter.sent`` is
    the ring-model total since the last :meth:`reset`, and ``counter.buffers`` the bytes of the
    buffers each kind of collective covered (``"broadcast"``, ``"all_gather"``, ...: the ``S``
    of each call, summed). Collectives DDP issues from C++ (its built-in all-reduce) are
    invisible to it: register ``allreduce_hook`` to count DDP.
    """

    def __init__(self) -> None:
        self.sent = 0.0
        self.calls = 0
        self.buffers: dict[str, int] = {}

    def reset(self) -> None:
        self.sent, self.calls, self.buffers = 0.0, 0, {}

    @contextlib.contextmanager
    def counting(self) -> Iterator[ByteCounter]:
        originals = {name: getattr(dist, name) for name in _OPS if hasattr(dist, name)}

        def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            op, size = _OPS[name]
            signature = inspect.signature(fn)
            position = _ARG.get(name, 0)

            def counted(*args: Any, **kwargs: Any) -> Any:
                bound = signature.bind(*args, **kwargs).arguments
                n = dist.get_world_size(bound.get("group"))
                tensor = list(bound.values())[position]
                self.sent += bytes_sent(op, size(tensor, n), n)
                self.calls += 1
                self.buffers[op] = self.buffers.get(op, 0) + size(tensor, n)
                return fn(*args, **kwargs)

            return counted

        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
