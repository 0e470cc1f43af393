"""Join: a rank that ran out of inputs shadows ``step()``'s collectives for the others."""

from __future__ import annotations

from typing import Protocol

from torch.distributed.algorithms.join import JoinHook

__all__ = ["StepJoinHook"]


class _Steps(Protocol):
    def step(self) -> object: ...


class StepJoinHook(JoinHook):
    """The hook ``Join([ddp, zero])`` runs on a joined rank: one ``step()`` per iteration of
    the others (its gradients are zeros, DDP's join hook sees to that), so that every
    collective of theirs has its partner.

    Example:
        >>> class Counter:
        ...     steps = 0
        ...     def step(self):
        ...         self.steps += 1
        >>> zero = Counter()
        >>> StepJoinHook(zero).main_hook()
        >>> zero.steps
        1
    """

    def __init__(self, zero: _Steps) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        """Shadow one ``step()``."""
        self.zero.step()
