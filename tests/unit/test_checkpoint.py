"""``checkpoint``'s helpers for plain optimizers, in one process (sharded checkpoints across
world sizes: ``tests/dist/test_checkpoint.py``)."""

from __future__ import annotations

import copy

import torch

from zero_functional import checkpoint


def test_checkpoint_helpers_for_plain_optimizers() -> None:
    flat = {
        "model.a": torch.ones(2),
        "state.a.step": torch.tensor(1.0),
        "state.b.exp_avg": torch.zeros(3),
        "param_groups": [{"lr": 0.1, "params": ["a"]}, {"lr": 0.2, "params": ["b"]}],
        "extra": None,
        "format": checkpoint.FORMAT,
    }
    sd = checkpoint.optimizer_state_dict(copy.deepcopy(flat))
    assert sd["param_groups"] == [{"lr": 0.1, "params": [0]}, {"lr": 0.2, "params": [1]}]
    assert set(sd["state"]) == {0, 1}
    assert list(checkpoint.model_state_dict(flat)) == ["a"]
