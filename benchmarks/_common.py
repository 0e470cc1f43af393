"""What every benchmark shares: the model, the launcher, medians, and a byte counter.

The byte counter wraps ``torch.distributed``'s collectives in the calling process and converts
each call's buffer into the bytes one rank sends under ring algorithms
(:func:`zero_functional.core.plans.bytes_sent`), so the bytes columns are counted from what
actually ran, not computed from a formula.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import inspect
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from zero_functional.app.launch import run_ranks
from zero_functional.core.plans import bytes_sent

__all__ = [
    "ByteCounter",
    "TinyGPT",
    "add_link_argument",
    "gpt_batch",
    "median_ms",
    "mlp",
    "run_ranks",
    "torch_step",
]

WIDTH = 1000


def mlp(numel: int, *, relu: bool = True, width: int = WIDTH) -> nn.Module:
    """``numel // width**2`` layers of Linear(width, width) (+ ReLU), seeded: the benchmark
    model (8 x Linear(1000, 1000) at 8M; ``--width 512 --numel 2097152``: 8 x Linear(512, 512))."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(max(1, numel // (width * width))):
        layers.append(nn.Linear(width, width))
        if relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and a 4x MLP (nanoGPT's)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc_proj = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """The transformer-shaped benchmark model (issue 24): nanoGPT's layout, scaled down.

    6 blocks of width 192 (6 heads), vocabulary 512, context 64, an untied output layer without
    bias: 77 parameter tensors, 2,878,464 parameters, half the tensors biases and LayerNorm
    vectors, as in GPT-2. ``forward(tokens)`` returns the logits; :meth:`loss` the mean
    cross-entropy against the next tokens. Seeded.

    Example:
        >>> m = TinyGPT()
        >>> len(list(m.parameters())), sum(p.numel() for p in m.parameters())
        (77, 2878464)
    """

    def __init__(
        self, blocks: int = 6, width: int = 192, vocab: int = 512, context: int = 64
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.context, self.vocab = context, vocab
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(_Block(width, heads=6) for _ in range(blocks)))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.head(self.ln_f(self.blocks(self.wte(tokens) + self.wpe(pos))))

    @staticmethod
    def loss(logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_batch(rank: int, batch: int = 8, context: int = 64, vocab: int = 512) -> Tensor:
    """``batch`` sequences of ``context + 1`` random tokens, seeded by ``rank`` (inputs are
    ``[:, :-1]``, targets ``[:, 1:]``)."""
    g = torch.Generator().manual_seed(rank)
    return torch.randint(vocab, (batch, context + 1), generator=g)


def torch_step(
    cls: type[torch.optim.Optimizer], params: list[Tensor], grads: list[Tensor], **kw: Any
) -> Callable[[], object]:
    """``cls(**kw)``'s ``step`` over fresh leaf copies of ``params`` whose ``.grad`` is ``grads``:
    a torch optimizer's kernel, timed alone beside ours on the same tensors."""
    ps = [nn.Parameter(p.clone()) for p in params]
    for p, g in zip(ps, grads):
        p.grad = g
    return cls(ps, **kw).step


def add_untimed_flags(ap: argparse.ArgumentParser) -> None:
    """The flags ``zero-functional bench`` forwards, for a script that times nothing: ``--rounds``
    and ``--numel`` accepted and ignored, ``--json`` given no rows (:func:`write_no_rows`)."""
    ap.add_argument("--rounds", type=int, help="ignored: nothing is timed")
    ap.add_argument("--numel", type=int, help="ignored: the models are fixed")
    ap.add_argument("--json", help="writes an empty list: no timing rows for bench's summary")


def write_no_rows(args: argparse.Namespace) -> None:
    """Where ``--json`` asks, the empty list of rows of a script that times nothing."""
    if args.json:
        Path(args.json).write_text("[]")


def add_link_argument(ap: argparse.ArgumentParser) -> None:
    """``--link RATE``: run the script on the loopback of a private network namespace shaped to
    RATE (:mod:`zero_functional.app.link`), where bytes cost what they cost on a network."""
    ap.add_argument(
        "--link",
        metavar="RATE",
        help="re-run on a loopback shaped to RATE (tc's syntax: 2gbit, 10gbit) in a private "
        "network namespace (unshare -rn); rows then show each variant's byte floor",
    )


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
    "all_to_all_single": ("all_to_all", lambda t, n: t.numel() * t.element_size()),
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
                if name == "all_to_all_single":  # what this rank sends: the others' splits
                    splits = bound.get("input_split_sizes")
                    source = bound["input"]
                    me = dist.get_rank(bound.get("group"))
                    elements = sum(splits) - splits[me] if splits else source.numel() * (n - 1) // n
                    self.sent += elements * source.element_size()
                    self.calls += 1
                    # the S of a reduce-scatter: the others' stretches sent, plus this rank's
                    # own (received from each of the others, or sent to itself)
                    own = max(bound.get("output_split_sizes") or [0])
                    covered = (elements + own) * source.element_size()
                    self.buffers["all_to_all"] = self.buffers.get("all_to_all", 0) + covered
                    return fn(*args, **kwargs)
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


def status_mib(field: str) -> float:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no {field} in /proc/self/status")


def start_peak() -> float:
    """Reset the peak resident set to the current one (Linux) and return the current one (MiB).

    Large allocations are mmapped (glibc's threshold lowered to 1 MiB, as
    ``MALLOC_MMAP_THRESHOLD_=1048576`` would), so a freed tensor leaves the resident set at once
    and the peak counts what is live, not what the heap kept from earlier.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return status_mib("VmRSS")
