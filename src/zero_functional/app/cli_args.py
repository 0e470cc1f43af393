"""The command line's argument types: bounded numbers whose errors say why the bound, and one-line
errors with exit code 2.

Example:
    >>> IntIn(1, 8, "ranks")("3"), str(IntIn(1, 8, "ranks")), str(PositiveFloat(60.0, "a minute"))
    (3, '1 to 8', 'above 0, up to 60')
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block), still with exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail(command: str, message: str) -> int:
    print(f"zero-functional {command}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:37] + "...")


@dataclass(frozen=True)
class IntIn:
    """An argparse type: an integer from ``low`` to ``high``; past ``high`` the error says
    ``why``. Called with ``cap=False`` (a config built in code), ``high`` holds only if ``hard``:
    otherwise it is the command line's sanity cap."""

    low: int
    high: int
    why: str = ""
    span: str = ""  # how the range reads, if not "from low to high"
    hard: bool = False

    def __str__(self) -> str:
        return self.span or f"{self.low:,} to {self.high:,}"

    def __call__(self, text: str, cap: bool = True) -> int:
        span = self.span or f"from {self}"
        try:
            value = int(text)
        except ValueError:  # not an integer, or more digits than int() takes
            raise argparse.ArgumentTypeError(
                f"expected an integer {span}, got {shown(text)}"
            ) from None
        if value < self.low or (value > self.high and (cap or self.hard)):
            why = f" ({self.why})" if self.why and value > self.high else ""
            raise argparse.ArgumentTypeError(f"expected an integer {span}{why}, got {shown(text)}")
        return value


@dataclass(frozen=True)
class PositiveFloat:
    """An argparse type: a finite number above 0 and, with ``cap``, at most ``high`` (``why``)."""

    high: float = math.inf
    why: str = ""

    def __str__(self) -> str:
        return "above 0" + (f", up to {self.high:,.0f}" if math.isfinite(self.high) else "")

    def __call__(self, text: str, cap: bool = True) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected a positive number, got {shown(text)}")
        if cap and value > self.high:
            raise argparse.ArgumentTypeError(
                f"expected a positive number up to {self.high:,.0f} ({self.why}), got {shown(text)}"
            )
        return value


local_ranks = IntIn(1, 64, "gloo ranks on this one machine")
"""Ranks ``train``, ``demo`` and ``bench`` start: gloo processes on this one machine."""
