"""Pure optimizers on tensor lists (SGD, Adam, AdamW), their compiled twins, the torch.optim
registry."""

from __future__ import annotations

from zero_functional.functional._common import group_indices
from zero_functional.functional.adam import (
    AdamState,
    adam_init,
    adam_update,
    adam_update_,
    adamw_update,
    adamw_update_,
)
from zero_functional.functional.compiled import (
    COMPILE_FASTER_FROM,
    choose_update,
    compile_policy,
    compiled_adam_update_,
    compiled_sgd_update_,
)
from zero_functional.functional.factories import FunctionalOptimizer, State, adam, adamw, sgd
from zero_functional.functional.registry import (
    IGNORED_GROUP_KEYS,
    OPTIMIZER_KINDS,
    SUPPORTED,
    FunctionalSpec,
    UpdateKind,
    functional_spec,
    group_hyperparams,
    register_optimizer,
    supports_group,
    update_kind,
)
from zero_functional.functional.sgd import SGDState, sgd_init, sgd_update, sgd_update_

__all__ = [
    "COMPILE_FASTER_FROM",
    "IGNORED_GROUP_KEYS",
    "OPTIMIZER_KINDS",
    "SUPPORTED",
    "AdamState",
    "FunctionalOptimizer",
    "FunctionalSpec",
    "SGDState",
    "State",
    "UpdateKind",
    "adam",
    "adam_init",
    "adam_update",
    "adam_update_",
    "adamw",
    "adamw_update",
    "adamw_update_",
    "choose_update",
    "compile_policy",
    "compiled_adam_update_",
    "compiled_sgd_update_",
    "functional_spec",
    "group_hyperparams",
    "group_indices",
    "register_optimizer",
    "sgd",
    "sgd_init",
    "sgd_update",
    "sgd_update_",
    "supports_group",
    "update_kind",
]
