"""The command line's argument types and limits, shared by its commands (:mod:`.cli`,
:mod:`.plan_cmd`): one-line errors with exit code 2, bounded integers and numbers.

Example:
    >>> int_in(1, 8, "ranks")("3")
    3
    >>> rank_list("0, 1023")
    [0, 1023]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn

__all__ = [
    "DEMO_WORLD_SIZES",
    "DIGITS_TRAIN_SIZE",
    "MAX_BENCH_NUMEL",
    "MAX_BENCH_ROUNDS",
    "MAX_BUCKET_CAP_MB",
    "MAX_EPOCHS",
    "MAX_HIDDEN",
    "MAX_LOCAL_RANKS",
    "MAX_PLAN_WORLD_SIZE",
    "MAX_SIMULATED_RANKS",
    "MAX_TIMEOUT_S",
    "Parser",
    "SEED_RANGE",
    "fail",
    "int_in",
    "local_ranks",
    "positive_float",
    "rank_list",
    "shown",
]

DEMO_WORLD_SIZES = (2, 8, 64)
"""The world sizes ``plan`` reports by default, and the demo's plan."""


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block), still with exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail(command: str, message: str) -> int:
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


def shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:37] + "...")


def int_in(low: int, high: int, why: str, span: str = "") -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high``; the error says why the bound."""
    span = span or f"from {low:,} to {high:,}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # not an integer, or more digits than int() takes
            raise argparse.ArgumentTypeError(
                f"expected an integer {span}, got {shown(text)}"
            ) from None
        if not low <= value <= high:
            reason = f" ({why})" if why and value > high else ""
            raise argparse.ArgumentTypeError(
                f"expected an integer {span}{reason}, got {shown(text)}"
            )
        return value

    return parse


def positive_float(high: float, why: str) -> Callable[[str], float]:
    """An argparse type: a finite number above 0 and at most ``high``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a positive number, got {shown(text)}"
            ) from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected a positive number, got {shown(text)}")
        if value > high:
            raise argparse.ArgumentTypeError(
                f"expected a positive number up to {high:,.0f} ({why}), got {shown(text)}"
            )
        return value

    return parse


local_ranks = int_in(1, MAX_LOCAL_RANKS, "gloo ranks on this one machine")


def rank_list(text: str) -> list[int]:
    """An argparse type: ranks separated by commas (``0,1023``), each an integer >= 0."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in parts) or len(parts) > MAX_SIMULATED_RANKS:
        raise argparse.ArgumentTypeError(
            f"expected up to {MAX_SIMULATED_RANKS} ranks (integers >= 0) separated by commas, "
            f"such as 0,1023, got {shown(text)}"
        )
    return [int(part) for part in parts]
