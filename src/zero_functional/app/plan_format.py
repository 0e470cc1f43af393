"""The tables ``zero-functional plan`` prints, from parameter sizes (the arithmetic is
:mod:`zero_functional.core.partition`'s): partition balance, bytes per rank, hybrid-sharding
traffic, Muon + AdamW ownership, in-memory snapshots' host memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from zero_functional.core.cost import muon_plan
from zero_functional.core.loads import (
    balance_report,
    hybrid_shape,
    max_over_mean,
    rank_bytes,
    rank_loads,
    rank_traffic,
)
from zero_functional.core.partition import flat, sorted_greedy

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of the dtypes ``--dtype`` and ``--main-params`` take."""
MUON_RANK_ROWS = 16
"""Most ranks :func:`format_muon` prints a row for; past it, the busiest rank's row only."""


def format_bytes(n: float) -> str:
    """A byte count in binary units.

    Example:
        >>> format_bytes(512), format_bytes(1536), format_bytes(3 * 2**30)
        ('512 B', '1.5 KiB', '3.0 GiB')
    """
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_plan(name: str, numels: Sequence[int], world_sizes: Sequence[int]) -> str:
    """The balance of sorted-greedy and flat partitions of ``numels`` at each world size: max/mean
    load, the bound on the max load of any whole-tensor partition (``max(mean, largest)``), the
    smallest and largest load, and the fullest rank's Adam state (``8 * load`` bytes) against
    ZeRO's formula (``8 * total / world_size``).

    Example:
        >>> print(format_plan("toy", [6, 3, 3], [2]))
        toy: 3 tensors, 12 parameters, largest 6 (50.0%)
        Adam state unsharded (2 fp32 states): 96 B; ZeRO's formula per rank: 8 B x 12 / world_size
        world  partition      max/mean  lower bound  max/lower     min load     max load  Adam/rank (max)  ZeRO formula  max/formula
            2  sorted-greedy     1.000            6      1.000            6            6             48 B          48 B        1.000
            2  flat              1.000            6      1.000            6            6             48 B          48 B        1.000
    """
    total = sum(numels)
    largest = max(numels, default=0)
    lines = [
        f"{name}: {len(numels):,} tensors, {total:,} parameters, largest {largest:,} "
        f"({largest / total if total else 0:.1%})",
        f"Adam state unsharded (2 fp32 states): {format_bytes(8 * total)}; "
        f"ZeRO's formula per rank: 8 B x {total:,} / world_size",
        f"{'world':>5}  {'partition':<13}  {'max/mean':>8}  {'lower bound':>11}  "
        f"{'max/lower':>9}  {'min load':>11}  {'max load':>11}  {'Adam/rank (max)':>15}  "
        f"{'ZeRO formula':>12}  {'max/formula':>11}",
    ]
    for w in world_sizes:
        formula = 8 * total / w
        for label, part in (("sorted-greedy", sorted_greedy(numels, w)), ("flat", flat(numels, w))):
            r = balance_report(numels, part)
            predicted = 8 * r.max_load
            lines.append(
                f"{w:>5}  {label:<13}  {r.max_over_mean:>8.3f}  {r.lower_bound:>11,.0f}  "
                f"{r.max_over_lower_bound:>9.3f}  {min(r.loads):>11,}  {r.max_load:>11,}  "
                f"{format_bytes(predicted):>15}  {format_bytes(formula):>12}  "
                f"{predicted / formula if formula else 1.0:>11.3f}"
            )
    return "\n".join(lines)


def format_memory(
    numels: Sequence[int],
    world_sizes: Sequence[int],
    dtype: str,
    main_params: str | None,
    optimizer: str = "adamw",
    remainders: bool = False,
    ema: bool = False,
    changes: bool = False,
) -> str:
    """Bytes per rank (the fullest rank) of an AdamW run, per world size and partition
    (``changes``: ``gather_dtype``'s main copies, kept for parameters of every width).

    Parameters and gradients are whole in ``dtype``; the main copy (only for parameters narrower
    than it; 2 B with ``remainders``), the moments (in the main dtype if any; block-quantized per
    whole tensor for a low-bit ``optimizer``) and the ``ema`` cover the owned elements.

    Example:
        >>> print(format_memory([6, 3, 3], [2], "bf16", "fp32"))
        bytes per rank (fullest rank): bf16 parameters and gradients, fp32 main copy, AdamW's 2 fp32 states
        world  partition          params       grads   main copy       state       total
            2  sorted-greedy        24 B        24 B        24 B        48 B       120 B
            2  flat                 24 B        24 B        24 B        48 B       120 B
        per parameter per rank (flat): 10.00 B at 2
    """
    from zero_functional.functional.lowbit import LOW_BIT  # imports torch: not for --help

    param_bytes = DTYPE_BYTES[dtype]
    main_bytes = DTYPE_BYTES[main_params] if main_params else 0
    has_main = main_bytes > param_bytes or (changes and main_bytes > 0)
    full = main_bytes if has_main else param_bytes  # the moments' and the EMA's dtype
    wide = main_params if has_main else dtype
    spec = LOW_BIT.get(optimizer)
    copy = f"{main_params} main copy" if has_main else "no main copy"
    if has_main and remainders:
        copy += f" as {dtype} + int16 remainders"
    states = f"{optimizer}'s 2 block-quantized states" if spec else f"AdamW's 2 {wide} states"
    columns = ("params", "grads", "main copy", "state", *(("ema",) if ema else ()), "total")
    lines = [
        f"bytes per rank (fullest rank): {dtype} parameters and gradients, {copy}, {states}"
        + (f", {wide} EMA" if ema else ""),
        f"{'world':>5}  {'partition':<13}  " + "  ".join(f"{c:>10}" for c in columns),
    ]
    total = sum(numels)

    def rank_cells(owned: Sequence[tuple[int, int]]) -> tuple[float, ...]:
        load = sum(n for _, n in owned)
        main = (2 if remainders else main_bytes) * load if has_main else 0
        if spec is None:
            state = 2.0 * full * load
        else:
            state = sum(spec.state_bytes(numels[k], full, n) for k, n in owned)
        extra = (full * load,) if ema else ()
        cells = (param_bytes * total, param_bytes * total, main, state, *extra)
        return (*cells, sum(cells))

    per_param = []
    for w in world_sizes:
        for label, owned in (
            ("sorted-greedy", [[(k, numels[k]) for k in ks] for ks in sorted_greedy(numels, w)]),
            ("flat", [[(p.param, p.numel) for p in ps] for ps in flat(numels, w).pieces]),
        ):
            cells = max((rank_cells(o) for o in owned), key=lambda c: c[-1])
            lines.append(
                f"{w:>5}  {label:<13}  " + "  ".join(f"{format_bytes(c):>10}" for c in cells)
            )
        per_param.append(f"{cells[-1] / total if total else 0:.2f} B at {w:,}")  # flat's total
    lines.append("per parameter per rank (flat): " + ", ".join(per_param))
    return "\n".join(lines)


def format_snapshots(
    numels: Sequence[int],
    world_sizes: Sequence[int],
    dtype: str,
    main_params: str | None,
    optimizer: str = "adamw",
    changes: bool = False,
) -> str:
    """Host memory per rank (the fullest rank) of ``checkpoint.snapshot``'s in-memory snapshots,
    per world size and partition (``plan --snapshots``).

    A rank keeps its share (its owned elements' optimizer state and main copy, and their
    parameter values in ``dtype``) and the copy of one other rank's share (none at one rank;
    counted as the largest other share). While a new snapshot is taken the old one stays until
    the new one is on both copies: the peak is twice that. Rank 0 also keeps the model's
    buffers, not counted here. The files add a few KiB of index and manifest per share.

    Example:
        >>> print(format_snapshots([6, 3, 3], [2], "fp32", None))
        in-memory snapshots, host memory per rank (fullest rank): its share (AdamW's 2 fp32 states, no main copy, its pieces' fp32 values) + the copy of another rank's it keeps; peak: the old and the new snapshot
        world  partition           share   copy kept    together        peak
            2  sorted-greedy        72 B        72 B       144 B       288 B
            2  flat                 72 B        72 B       144 B       288 B
    """
    from zero_functional.functional.lowbit import LOW_BIT  # imports torch: not for --help

    param_bytes = DTYPE_BYTES[dtype]
    main_bytes = DTYPE_BYTES[main_params] if main_params else 0
    has_main = main_bytes > param_bytes or (changes and main_bytes > 0)
    full = main_bytes if has_main else param_bytes
    wide = main_params if has_main else dtype
    spec = LOW_BIT.get(optimizer)
    copy = f"{main_params} main copy" if has_main else "no main copy"
    states = f"{optimizer}'s 2 block-quantized states" if spec else f"AdamW's 2 {wide} states"
    lines = [
        "in-memory snapshots, host memory per rank (fullest rank): its share "
        f"({states}, {copy}, its pieces' {dtype} values) + the copy of another rank's it keeps; "
        "peak: the old and the new snapshot",
        f"{'world':>5}  {'partition':<13}  "
        + "  ".join(f"{c:>10}" for c in ("share", "copy kept", "together", "peak")),
    ]

    def share(owned: Sequence[tuple[int, int]]) -> float:
        load = sum(n for _, n in owned)
        if spec is None:
            state = 2.0 * full * load
        else:
            state = sum(spec.state_bytes(numels[k], full, n) for k, n in owned)
        return state + (main_bytes * load if has_main else 0) + param_bytes * load

    for w in world_sizes:
        for label, owned in (
            ("sorted-greedy", [[(k, numels[k]) for k in ks] for ks in sorted_greedy(numels, w)]),
            ("flat", [[(p.param, p.numel) for p in ps] for ps in flat(numels, w).pieces]),
        ):
            shares = sorted((share(o) for o in owned), reverse=True)
            mine, kept = shares[0], shares[1] if w > 1 else 0.0
            cells = (mine, kept, mine + kept, 2 * (mine + kept))
            lines.append(
                f"{w:>5}  {label:<13}  " + "  ".join(f"{format_bytes(c):>10}" for c in cells)
            )
    return "\n".join(lines)


def format_wire(
    numels: Sequence[int],
    world_sizes: Sequence[int],
    dtype: str,
    wire: str | None,
    gather: str | None,
) -> str:
    """Bytes each rank sends per step (ring model) for DDP's all-reduce and for ours with
    gradients in ``wire`` and parameters' changes in ``gather`` (``None``: the model's dtype).

    Example:
        >>> print(format_wire([1024], [2], "fp32", "int8", "int8"))
        bytes per rank and step: 4.0 KiB of fp32 gradients (and as many parameters)
        world   DDP all-reduce  ours: gradients  ours: parameters       ours  x DDP
            2          4.0 KiB            520 B             520 B    1.0 KiB  0.254
    """
    from zero_functional.comm import WIRE_NAMES, Codec  # imports torch: not for --help

    total, element = sum(numels), DTYPE_BYTES[dtype]

    def on_wire(name: str | None) -> float:
        return element * total if name is None else Codec(WIRE_NAMES[name]).nbytes(total)

    lines = [
        f"bytes per rank and step: {format_bytes(element * total)} of {dtype} gradients (and "
        "as many parameters)",
        f"{'world':>5}  {'DDP all-reduce':>15}  {'ours: gradients':>15}  "
        f"{'ours: parameters':>16}  {'ours':>9}  x DDP",
    ]
    for w in world_sizes:
        share = (w - 1) / w
        ddp, grads, params = (
            2 * share * element * total,
            share * on_wire(wire),
            share * on_wire(gather),
        )
        ratio = f"{(grads + params) / ddp:.3f}" if ddp else "-"
        lines.append(
            f"{w:>5}  {format_bytes(ddp):>15}  {format_bytes(grads):>15}  "
            f"{format_bytes(params):>16}  {format_bytes(grads + params):>9}  {ratio}"
        )
    return "\n".join(lines)


def format_hybrid(
    numels: Sequence[int],
    world_sizes: Sequence[int],
    shard_size: int,
    dtype: str = "fp32",
    main_params: str | None = None,
) -> str:
    """State and bytes moved per rank and step under hybrid sharding (``W / shard_size``
    replica groups of ``shard_size`` ranks, a node), against 1-D ZeRO over the world
    (:func:`~zero_functional.core.loads.rank_traffic`).

    Example:
        >>> print(format_hybrid([6, 3, 3], [4], 2))
        hybrid sharding, shard size 2: state sharded within each group of 2 ranks (a node), replicated across the world/2 groups
        per rank and step, B = 48 B of fp32 gradients (and as many parameters); state: AdamW's 2 fp32 states of the owned elements
                               state/rank (fullest)          bytes/rank/step         1-D ZeRO over the world
        world  replicas x S        flat  sorted-greedy  within node  across nodes  state/rank  bytes/rank/step
            4         2 x 2        48 B           48 B         48 B          24 B        24 B             72 B
    """
    param_bytes = DTYPE_BYTES[dtype]
    main_bytes = DTYPE_BYTES[main_params] if main_params else 0
    has_main = main_bytes > param_bytes
    total = sum(numels)
    nbytes = param_bytes * total

    def state(load: int) -> int:
        b = rank_bytes(load, total, param_bytes=param_bytes, main_bytes=main_bytes)
        return b.main + b.state

    what = f"{main_params} main copy and " if has_main else ""
    lines = [
        f"hybrid sharding, shard size {shard_size}: state sharded within each group of "
        f"{shard_size} ranks (a node), replicated across the world/{shard_size} groups",
        f"per rank and step, B = {format_bytes(nbytes)} of {dtype} gradients (and as many "
        f"parameters); state: {what}AdamW's 2 {main_params if has_main else dtype} states of "
        "the owned elements",
        f"{'':>19}  {'state/rank (fullest)':^25}  {'bytes/rank/step':^25}  "
        f"{'1-D ZeRO over the world':^27}".rstrip(),
        f"{'world':>5}  {'replicas x S':>12}  {'flat':>10}  {'sorted-greedy':>13}  "
        f"{'within node':>11}  {'across nodes':>12}  {'state/rank':>10}  {'bytes/rank/step':>15}",
    ]
    for w in world_sizes:
        replicas, shards = hybrid_shape(w, shard_size)
        traffic = rank_traffic(nbytes, shards, replicas)
        greedy = max(rank_loads(numels, sorted_greedy(numels, shards)))
        one_d = rank_traffic(nbytes, w)
        lines.append(
            f"{w:>5}  {f'{replicas} x {shards}':>12}  "
            f"{format_bytes(state(max(flat(numels, shards).loads))):>10}  "
            f"{format_bytes(state(greedy)):>13}  {format_bytes(traffic.within):>11}  "
            f"{format_bytes(traffic.across):>12}  "
            f"{format_bytes(state(max(flat(numels, w).loads))):>10}  "
            f"{format_bytes(one_d.within):>15}"
        )
    return "\n".join(lines)


def format_muon(
    shapes: Sequence[Sequence[int]], muon: Sequence[bool], world_sizes: Sequence[int]
) -> str:
    """Per rank, the state bytes and Newton–Schulz cost of Muon (the matrices where ``muon``,
    owned whole, balanced by cost) + AdamW (the rest, split flat), and their max/mean; past
    :data:`MUON_RANK_ROWS` ranks, the busiest rank's values only
    (:func:`~zero_functional.core.cost.muon_plan`).

    Example:
        >>> print(format_muon([(8, 8), (8,), (4, 8), (4, 8)], [True, False, True, True], [2]))
        Muon on 3 matrices (128 parameters), whole, balanced by Newton-Schulz cost m*n*min(m,n); AdamW on the other 1 tensors (8 parameters), split flat
        fp32 state per owned element: Muon's momentum_buffer 4 B, AdamW's exp_avg and exp_avg_sq 8 B
        world  rank      matrices  Muon elements  AdamW elements  state bytes  Newton-Schulz cost
            2  0                1             64               4        288 B                 512
            2  1                2             64               4        288 B                 256
            2  max/mean                                                 1.000               1.333
    """
    sizes = [math.prod(s) for s in shapes]
    on_muon, matrices = sum(n for n, m in zip(sizes, muon) if m), sum(map(bool, muon))
    lines = [
        f"Muon on {matrices:,} matrices ({on_muon:,} parameters), whole, balanced by "
        f"Newton-Schulz cost m*n*min(m,n); AdamW on the other {len(muon) - matrices:,} "
        f"tensors ({sum(sizes) - on_muon:,} parameters), split flat",
        "fp32 state per owned element: Muon's momentum_buffer 4 B, AdamW's exp_avg and "
        "exp_avg_sq 8 B",
        f"{'world':>5}  {'rank':<8}  {'matrices':>8}  {'Muon elements':>13}  "
        f"{'AdamW elements':>14}  {'state bytes':>11}  {'Newton-Schulz cost':>18}",
    ]
    for w in world_sizes:
        plan = muon_plan(shapes, muon, w)
        columns = (
            tuple(map(len, plan.matrix_owned)),
            plan.muon_numel,
            plan.adamw_numel,
            plan.state_bytes,
            plan.cost,
        )
        rows = zip(*columns) if w <= MUON_RANK_ROWS else [tuple(max(c) for c in columns)]
        labels = map(str, range(w)) if w <= MUON_RANK_ROWS else ["max"]
        for label, (count, m, a, state, cost) in zip(labels, rows):
            lines.append(
                f"{w:>5}  {label:<8}  {count:>8,}  {m:>13,}  {a:>14,}  "
                f"{format_bytes(state):>11}  {cost:>18,}"
            )
        lines.append(
            f"{w:>5}  {'max/mean':<8}  {'':>8}  {'':>13}  {'':>14}  "
            f"{max_over_mean(plan.state_bytes):>11.3f}  {max_over_mean(plan.cost):>18.3f}"
        )
    return "\n".join(lines)
