"""What ``zero-functional plan`` prints: partition balance, bytes per rank, hybrid-sharding traffic.

Each function formats one table from parameter sizes; the arithmetic is in
:mod:`zero_functional.partition` (pure). :mod:`zero_functional.cli` re-exports these names.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DTYPE_BYTES", "format_memory", "format_plan"]


def format_plan(name: str, numels: Sequence[int], world_sizes: Sequence[int]) -> str:
    """The balance of sorted-greedy and flat partitions of ``numels`` at each world size.

    Per world size and partition: max/mean load, the lower bound on the max load of any
    whole-tensor partition (``max(mean, largest tensor)``), max/lower bound (below 1 for
    ``flat``, which splits tensors), the smallest and largest rank load, and the Adam state of the fullest rank (2 fp32 states: ``8 * load`` bytes)
    against ZeRO's formula (``8 * total / world_size``).

    Args:
        name: The model's name, for the header.
        numels: Each parameter tensor's number of elements, in ``parameters()`` order.
        world_sizes: The world sizes to report.

    Returns:
        The report, one header and a table.

    Example:
        >>> print(format_plan("toy", [6, 3, 3], [2]))
        toy: 3 tensors, 12 parameters, largest 6 (50.0%)
        Adam state unsharded (2 fp32 states): 96 B; ZeRO's formula per rank: 8 B x 12 / world_size
        world  partition      max/mean  lower bound  max/lower     min load     max load  Adam/rank (max)  ZeRO formula  max/formula
            2  sorted-greedy     1.000            6      1.000            6            6             48 B          48 B        1.000
            2  flat              1.000            6      1.000            6            6             48 B          48 B        1.000
    """
    from zero_functional.partition import balance_report, flat, sorted_greedy
    from zero_functional.train import format_bytes

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


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of the dtypes ``--dtype`` and ``--main-params`` take."""


def format_memory(
    numels: Sequence[int], world_sizes: Sequence[int], dtype: str, main_params: str | None
) -> str:
    """Bytes per rank (the fullest rank) of an AdamW run, per world size and partition.

    Parameters and gradients are in ``dtype`` on every rank; the main copy
    (``main_params_dtype``, only for parameters narrower than it) and AdamW's two moments
    (in the main dtype with a main copy, else in ``dtype``) cover the owned elements
    (:func:`zero_functional.partition.rank_bytes`).

    Example:
        >>> print(format_memory([6, 3, 3], [2], "bf16", "fp32"))
        bytes per rank (fullest rank): bf16 parameters and gradients, fp32 main copy, AdamW's 2 fp32 states
        world  partition          params       grads   main copy       state       total
            2  sorted-greedy        24 B        24 B        24 B        48 B       120 B
            2  flat                 24 B        24 B        24 B        48 B       120 B
    """
    from zero_functional.partition import flat, rank_bytes, rank_loads, sorted_greedy
    from zero_functional.train import format_bytes

    param_bytes = DTYPE_BYTES[dtype]
    main_bytes = DTYPE_BYTES[main_params] if main_params else 0
    has_main = main_bytes > param_bytes
    copy = f"{main_params} main copy" if has_main else "no main copy"
    lines = [
        f"bytes per rank (fullest rank): {dtype} parameters and gradients, {copy}, "
        f"AdamW's 2 {main_params if has_main else dtype} states",
        f"{'world':>5}  {'partition':<13}  "
        + "  ".join(f"{c:>10}" for c in ("params", "grads", "main copy", "state", "total")),
    ]
    total = sum(numels)
    for w in world_sizes:
        for label, loads in (
            ("sorted-greedy", rank_loads(numels, sorted_greedy(numels, w))),
            ("flat", flat(numels, w).loads),
        ):
            b = rank_bytes(max(loads), total, param_bytes=param_bytes, main_bytes=main_bytes)
            cells = (b.params, b.grads, b.main, b.state, b.total)
            lines.append(
                f"{w:>5}  {label:<13}  " + "  ".join(f"{format_bytes(c):>10}" for c in cells)
            )
    return "\n".join(lines)
