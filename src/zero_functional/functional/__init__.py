"""Pure optimizers on tensor lists (SGD, Adam, AdamW) and the torch.optim registry."""

from __future__ import annotations

from zero_functional.functional.adam import (
    AdamState,
    adam_init,
    adam_update,
    adam_update_,
    adamw_update,
    adamw_update_,
)
from zero_functional.functional.factories import FunctionalOptimizer, State, adam, adamw, sgd
from zero_functional.functional.registry import (
    IGNORED_GROUP_KEYS,
    SUPPORTED,
    FunctionalSpec,
    functional_spec,
    group_hyperparams,
    supports_group,
)
from zero_functional.functional.sgd import SGDState, sgd_init, sgd_update, sgd_update_

__all__ = [
    "IGNORED_GROUP_KEYS",
    "SUPPORTED",
    "AdamState",
    "FunctionalOptimizer",
    "FunctionalSpec",
    "SGDState",
    "State",
    "adam",
    "adam_init",
    "adam_update",
    "adam_update_",
    "adamw",
    "adamw_update",
    "adamw_update_",
    "functional_spec",
    "group_hyperparams",
    "sgd",
    "sgd_init",
    "sgd_update",
    "sgd_update_",
    "supports_group",
]
