"""Hugging Face Accelerate: ``save_state`` writes the main process's ``state_dict()`` of each
optimizer, so a ZeRO optimizer's state is first gathered there, on every rank, by a save-state
pre-hook (:func:`register`). ``prepare`` and ``load_state`` need nothing.

Usage::

    model, optimizer = accelerator.prepare(model, ZeroRedundancyOptimizer(...))
    zero_functional.integrations.accelerate.register(accelerator, optimizer)
    accelerator.save_state("ckpt")  # optimizer.bin in torch's format; loads at any world size
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from zero_functional.integrations._common import rank_of_global_zero, saved_on_each_node, unwrap

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["register"]


def register(accelerator: Accelerator, *optimizers: Optimizer) -> RemovableHandle:
    """Make ``accelerator.save_state`` consolidate ``optimizers`` (ZeRO optimizers, as
    ``prepare`` returned them or as built) on the main process first; returns the hook's handle.

    Raises:
        TypeError: An optimizer is not (and does not wrap) a ZeroRedundancyOptimizer.
        ValueError: No optimizer, or ``save_on_each_node`` (the state is gathered on one process).

    Example:
        >>> register(object())
        Traceback (most recent call last):
        ...
        ValueError: register(accelerator, *optimizers) needs the ZeroRedundancyOptimizers to consolidate before save_state, e.g. register(accelerator, optimizer) with the optimizer that accelerator.prepare returned
    """
    if not optimizers:
        raise ValueError(
            "register(accelerator, *optimizers) needs the ZeroRedundancyOptimizers to "
            "consolidate before save_state, e.g. register(accelerator, optimizer) with the "
            "optimizer that accelerator.prepare returned"
        )
    zeros = []
    for i, optimizer in enumerate(optimizers):
        zero = unwrap(optimizer)
        if zero is None:
            raise TypeError(
                f"optimizer {i} is a {type(optimizer).__name__}, not a zero_functional "
                "ZeroRedundancyOptimizer (nor an AcceleratedOptimizer around one): pass only "
                "ZeRO optimizers; Accelerate saves the others without help"
            )
        zeros.append((zero, rank_of_global_zero(zero)))
    if accelerator.project_configuration.save_on_each_node:
        raise saved_on_each_node("ProjectConfiguration")

    def consolidate(*_: object) -> None:
        for zero, to in zeros:
            zero.consolidate_state_dict(to=to)

    return cast(RemovableHandle, accelerator.register_save_state_pre_hook(consolidate))
