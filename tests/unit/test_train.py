"""The train job's options in one process (the job itself, on ranks: ``tests/dist/test_train.py``)."""

from __future__ import annotations

import torch

from zero_functional.app import train
from zero_functional.app.train_options import DIGITS_TRAIN_SIZE


def test_the_largest_batch_the_command_line_takes_is_the_training_set() -> None:
    assert len(train.load_digits_split()[1]) == DIGITS_TRAIN_SIZE


def test_the_digits_are_scikit_learns() -> None:
    # read from scikit-learn's file without importing it: the same images and labels, the split fixed
    from sklearn.datasets import load_digits

    data = load_digits()
    x_train, y_train, x_test, y_test = train.load_digits_split()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, kept = perm[: len(y) // 5], perm[len(y) // 5 :]
    for ours, theirs in (
        (x_train, x[kept]),
        (y_train, y[kept]),
        (x_test, x[test]),
        (y_test, y[test]),
    ):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_steps_per_epoch_counts_the_batches_an_epoch_makes() -> None:
    # a snapshot's step becomes (epochs done, steps into the next) by this count
    for batch_size in (1, 7, 64, 100, 719, 1437, DIGITS_TRAIN_SIZE):
        batches = train.epoch_batches(DIGITS_TRAIN_SIZE, batch_size, seed=0, epoch=0)
        assert train.steps_per_epoch(batch_size) == len(batches)
