"""Hugging Face Transformers: a ``Trainer`` saves ``optimizer.state_dict()`` on the process that
writes the checkpoint only, so :class:`ZeroTrainerCallback` gathers a ZeRO optimizer's state
there first, on every rank, wherever the ``Trainer`` decides to save: after a step or an epoch
(once ``control.should_save`` is set), and after an evaluation under ``save_strategy="best"``.
Resuming needs nothing.

Usage::

    Trainer(model, args, optimizers=(zero, scheduler), callbacks=[ZeroTrainerCallback()])
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainingArguments

from zero_functional.integrations._common import rank_of_global_zero, saved_on_each_node, unwrap

__all__ = ["ZeroTrainerCallback"]


class ZeroTrainerCallback(TrainerCallback):
    """Consolidates a ZeRO optimizer's state on every rank before the ``Trainer`` saves it: put
    it after any callback of yours that sets ``control.should_save``. A no-op for any other
    optimizer, for ``save_only_model=True``, and when nothing is saved.

    Example:
        >>> from transformers import TrainerControl
        >>> ZeroTrainerCallback().consolidate_if_saving(None, TrainerControl(), None)
        False
    """

    def consolidate_if_saving(
        self, args: TrainingArguments | None, control: TrainerControl, optimizer: object
    ) -> bool:
        """Consolidate on every rank if ``control`` says a checkpoint is saved next; whether
        it did."""
        zero = unwrap(optimizer)
        if zero is None or not control.should_save or getattr(args, "save_only_model", False):
            return False
        if getattr(args, "save_on_each_node", False):
            raise saved_on_each_node("TrainingArguments")
        zero.consolidate_state_dict(to=rank_of_global_zero(zero))
        return True

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        """After the flow callback decided whether this step (or epoch) saves."""
        self.consolidate_if_saving(args, control, kwargs.get("optimizer"))

    on_epoch_end = on_step_end

    def on_evaluate(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        """Under ``save_strategy="best"`` the save is decided after this event: be ready."""
        if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
            ready = TrainerControl(should_save=True)
            self.consolidate_if_saving(args, ready, kwargs.get("optimizer"))
