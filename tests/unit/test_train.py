"""The train job's options in one process (the job itself, on ranks: ``tests/dist/test_train.py``)."""

from __future__ import annotations

from zero_functional.app import train
from zero_functional.app.train_options import DIGITS_TRAIN_SIZE


def test_the_largest_batch_the_command_line_takes_is_the_training_set() -> None:
    assert len(train.load_digits_split()[1]) == DIGITS_TRAIN_SIZE


def test_steps_per_epoch_counts_the_batches_an_epoch_makes() -> None:
    # a snapshot's step becomes (epochs done, steps into the next) by this count
    for batch_size in (1, 7, 64, 100, 719, 1437, DIGITS_TRAIN_SIZE):
        batches = train.epoch_batches(DIGITS_TRAIN_SIZE, batch_size, seed=0, epoch=0)
        assert train.steps_per_epoch(batch_size) == len(batches)
