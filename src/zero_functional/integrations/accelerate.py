"""Hugging Face Accelerate: ``save_state`` of ZeRO optimizers, through a save-state pre-hook.

``Accelerator.save_state`` calls every prepared optimizer's ``state_dict()`` on every rank and
writes the main process's. A :class:`~zero_functional.optimizer.ZeroRedundancyOptimizer`
holds each rank's share only, so the full state must be gathered on the main process first,
by a collective on every rank: :func:`register` installs a hook (Accelerate's own
``register_save_state_pre_hook``) that does it. ``load_state`` needs nothing: each rank loads
its pieces from the full dict. ``accelerator.prepare(model, optimizer)`` needs nothing either.

Usage::

    accelerator = Accelerator()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    model, optimizer = accelerator.prepare(model, zero)
    zero_functional.integrations.accelerate.register(accelerator, optimizer)
    ...
    accelerator.save_state("ckpt")   # optimizer.bin: torch's format, loads into plain AdamW
    accelerator.load_state("ckpt")   # at any world size, under either partition
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from zero_functional.integrations._common import rank_of_global_zero, unwrap

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["register"]


def register(accelerator: Accelerator, *optimizers: Optimizer) -> RemovableHandle:
    """Make ``accelerator.save_state`` consolidate ``optimizers`` on the main process first.

    The hook runs on every rank inside ``save_state``, before the optimizers' ``state_dict()``
    is taken: each ZeRO optimizer's ``consolidate_state_dict`` gathers the full state on the
    rank that writes it.

    Args:
        accelerator: The ``accelerate.Accelerator`` whose ``save_state`` will be called.
        *optimizers: The ZeRO optimizers, as ``prepare`` returned them (an
            ``AcceleratedOptimizer``) or as built.

    Returns:
        The handle of the hook (``handle.remove()`` takes it out).

    Raises:
        TypeError: An optimizer is not (and does not wrap) a ZeroRedundancyOptimizer.
        ValueError: No optimizer given, or ``save_on_each_node`` (the state is gathered on
            one process only).

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
        raise ValueError(
            "ProjectConfiguration(save_on_each_node=True) writes the optimizer on each node's "
            "first process, but a ZeroRedundancyOptimizer's state is gathered on one process: "
            "save with save_on_each_node=False (the default)"
        )

    def consolidate(*_: object) -> None:
        for zero, to in zeros:
            zero.consolidate_state_dict(to=to)

    handle: RemovableHandle = accelerator.register_save_state_pre_hook(consolidate)
    return handle
