"""Checks and arithmetic that several pure modules share (private): each written once."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

MESSAGES_SHOWN = 3
MESSAGE_CHARS = 1500  # what the different messages shown share (4,096 stay <= 2 KB)


def check_world_size(world_size: object) -> None:
    """Raise a ValueError naming the fix unless ``world_size`` is an int >= 1."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"world_size must be an int >= 1, got {world_size!r}: pass dist.get_world_size() "
            "(1 for a single process)"
        )


def check_rank(rank: object, world_size: int) -> None:
    """Raise a ValueError unless ``rank`` is an int in ``range(world_size)``."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(
            f"rank {rank!r} is not a rank of {world_size}: pass an int in 0..{world_size - 1}"
        )


def check_align(align: object) -> None:
    """Raise a ValueError naming the fix unless ``align`` is an int >= 1."""
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"align must be an int >= 1, got {align!r}: pass 1 for no alignment")


def check_numels(numels: Sequence[int]) -> None:
    """Raise a ValueError naming the first negative (or non-int) size."""
    for i, n in enumerate(numels):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"numels[{i}] is {n!r}; sizes must be ints >= 0: pass tensor.numel()")


def prefix_sums(numels: Sequence[int]) -> list[int]:
    """``[0, n0, n0 + n1, ...]``: where each of ``numels`` starts when laid end to end."""
    return list(accumulate(numels, initial=0))


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers (exact past 2**53, where floats are not)."""
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``a``."""
    return ceil_div(a, multiple) * multiple


def first_of(items: Sequence[object], shown: int = 8) -> str:
    """``items`` as one short text at any length: the first ``shown``, then how many more.

    Example:
        >>> first_of(range(1270))
        '0, 1, 2, 3, 4, 5, 6, 7 and 1262 more'
    """
    named = ", ".join(str(item) for item in items[:shown])
    return named + (f" and {len(items) - shown} more" if len(items) > shown else "")


def by_rank(messages: Sequence[tuple[int, str]], shown: int = 4, sep: str = ": ") -> str:
    """``(rank, message)`` pairs as one short text at any world size: ranks saying the same share
    an entry; the first ``MESSAGES_SHOWN`` messages share ``MESSAGE_CHARS``, the rest are counted.

    Example:
        >>> by_rank([(r, "timed out") for r in range(1, 1024)] + [(0, "bad key")])
        'rank 0: bad key; ranks 1, 2, 3, 4 and 1019 more: timed out'
    """
    groups: dict[str, list[int]] = {}
    for rank, message in sorted(messages):
        groups.setdefault(message, []).append(rank)
    parts = []
    ordered = sorted(groups.items(), key=lambda item: item[1][0])
    share = MESSAGE_CHARS // min(len(ordered), MESSAGES_SHOWN) if ordered else MESSAGE_CHARS
    for message, ranks in ordered[:MESSAGES_SHOWN]:
        if len(message) > share:
            message = message[:share] + "... (cut)"
        parts.append(
            f"{'rank' if len(ranks) == 1 else 'ranks'} {first_of(ranks, shown)}{sep}{message}"
        )
    if rest := sum(len(ranks) for _, ranks in ordered[MESSAGES_SHOWN:]):
        parts.append(f"and {rest} more {'rank' if rest == 1 else 'ranks'} with other messages")
    return "; ".join(parts)
