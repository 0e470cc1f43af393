"""Hugging Face Transformers: checkpoints of a ``Trainer`` whose optimizer is ZeRO.

``Trainer(optimizers=(zero, scheduler))`` saves the optimizer on the process that writes the
checkpoint only (``args.should_save``), with ``optimizer.state_dict()``. A
:class:`~zero_functional.optimizer.ZeroRedundancyOptimizer` holds each rank's share, so every
rank must first gather the full state on that process (a collective).
:class:`ZeroTrainerCallback` does it at the moments the ``Trainer`` decides to save: at the end
of a step or an epoch once the flow callbacks have set ``control.should_save``, and after an
evaluation under ``save_strategy="best"`` (every rank reaches each of these together).
Resuming (``trainer.train(resume_from_checkpoint=...)``) needs nothing: every rank loads its
pieces from the full dict.

Usage::

    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    trainer = Trainer(model, args, train_dataset=data,
                      optimizers=(zero, LambdaLR(zero, lambda step: 1.0)),
                      callbacks=[ZeroTrainerCallback()])
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from zero_functional.integrations._common import rank_of_global_zero, unwrap

__all__ = ["ZeroTrainerCallback"]


class ZeroTrainerCallback(TrainerCallback):
    """Consolidates a ZeRO optimizer's state on every rank before the ``Trainer`` saves it.

    Put it in ``Trainer(callbacks=[...])`` after any callback of yours that sets
    ``control.should_save`` (the ``Trainer``'s own flow callback always runs first). A no-op
    for any other optimizer, for ``save_only_model=True``, and when nothing is saved.

    Example:
        >>> from transformers import TrainerControl
        >>> ZeroTrainerCallback().consolidate_if_saving(None, TrainerControl(), None)
        False
    """

    def consolidate_if_saving(
        self, args: TrainingArguments | None, control: TrainerControl, optimizer: object
    ) -> bool:
        """Consolidate on every rank if ``control`` says a checkpoint is saved next.

        Returns:
            Whether it consolidated.
        """
        zero = unwrap(optimizer)
        if zero is None or not control.should_save or getattr(args, "save_only_model", False):
            return False
        if getattr(args, "save_on_each_node", False):
            raise ValueError(
                "TrainingArguments(save_on_each_node=True) writes the optimizer on each node's "
                "first process, but a ZeroRedundancyOptimizer's state is gathered on one "
                "process: train with save_on_each_node=False (the default)"
            )
        zero.consolidate_state_dict(to=rank_of_global_zero(zero))
        return True

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """After the flow callback decided whether this step saves."""
        self.consolidate_if_saving(args, control, kwargs.get("optimizer"))

    def on_epoch_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """After the flow callback decided whether this epoch saves."""
        self.consolidate_if_saving(args, control, kwargs.get("optimizer"))

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Under ``save_strategy="best"`` the save is decided after this event: be ready."""
        if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
            ready = TrainerControl(should_save=True)
            self.consolidate_if_saving(args, ready, kwargs.get("optimizer"))
