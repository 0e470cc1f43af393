"""The package's public names: each one resolves, from the module the lazy table names."""

from __future__ import annotations

import importlib

import zero_functional


def test_every_public_name_resolves_to_the_object_its_module_defines() -> None:
    for name in zero_functional.__all__:
        value = getattr(zero_functional, name)
        module = importlib.import_module(zero_functional._HOME[name])
        assert value is getattr(module, name), name
    assert sorted(zero_functional._HOME) == sorted(zero_functional.__all__)


def test_one_checkpoint_error_caught_as_either_base_it_had() -> None:
    from zero_functional import checkpoint
    from zero_functional.app import train_file
    from zero_functional.checkpoint import storage

    error = storage.CheckpointError
    assert checkpoint.CheckpointError is error
    assert train_file.CheckpointError is error  # the train job's file raises the same class
    assert issubclass(error, RuntimeError) and issubclass(error, ValueError)
    assert issubclass(storage.CheckpointCorruptError, error)


def test_a_piece_has_one_name_and_knows_its_parameters_size() -> None:
    from zero_functional.core import partition

    assert not hasattr(partition, "Segment")  # issue 40: the old name went
    part = partition.flat([3, 5], 2)
    assert not hasattr(part, "segments")
    assert part.pieces[1][0] == partition.Piece(param=1, start=1, stop=5, param_numel=5)
    assert part.pieces[1][0].param_numel == 5 and not part.pieces[1][0].is_whole
