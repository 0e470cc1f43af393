"""Join: a rank that ran out of inputs shadows ``step()``'s collectives for the others."""

from __future__ import annotations

from typing import Protocol

from torch.distributed.algorithms.join import JoinHook


class _Steps(Protocol):
    def step(self) -> object: ...


class StepJoinHook(JoinHook):
    """``Join([ddp, zero])``'s hook on a joined rank: one ``step()`` per iteration of the others.

    Example:
        >>> class Counter:
        ...     def step(self):
        ...         print("step")
        >>> StepJoinHook(Counter()).main_hook()
        step
    """

    def __init__(self, zero: _Steps) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        """Shadow one ``step()``."""
        self.zero.step()
