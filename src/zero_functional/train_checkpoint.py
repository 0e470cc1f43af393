"""The train job's checkpoint names where they were before :mod:`zero_functional.checkpoint_format`
took the format: each is :mod:`zero_functional.train`'s, kept importable from here.

Example:
    >>> from zero_functional import train
    >>> load_checkpoint is train.load_checkpoint
    True
"""

from __future__ import annotations

from zero_functional.train import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)

__all__ = ["CHECKPOINT_FORMAT", "CheckpointError", "load_checkpoint", "save_checkpoint"]
