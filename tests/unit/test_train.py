"""The train job's options in one process (the job itself, on ranks: ``tests/dist/test_train.py``)."""

from __future__ import annotations

from zero_functional.app import train
from zero_functional.app.train_options import DIGITS_TRAIN_SIZE


def test_the_largest_batch_the_command_line_takes_is_the_training_set() -> None:
    assert len(train.load_digits_split()[1]) == DIGITS_TRAIN_SIZE
