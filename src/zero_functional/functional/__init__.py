"""Pure optimizers on tensor lists (SGD, Adam, AdamW): the public names of the functional core."""

from __future__ import annotations

from zero_functional.functional._common import group_indices
from zero_functional.functional.adam import (
    AdamHyper,
    AdamState,
    adam_apply_,
    adam_init,
    adam_update,
    adam_update_,
    adamw_update,
    adamw_update_,
)
from zero_functional.functional.compiled import COMPILE_FASTER_FROM, compile_policy
from zero_functional.functional.factories import FunctionalOptimizer, adam, adamw, sgd
from zero_functional.functional.registry import (
    IGNORED_GROUP_KEYS,
    OPTIMIZER_KINDS,
    SUPPORTED,
    FunctionalSpec,
    State,
    UpdateKind,
    functional_spec,
    group_hyperparams,
    register_optimizer,
    supports_group,
    update_kind,
)
from zero_functional.functional.sgd import (
    SGDHyper,
    SGDState,
    sgd_apply_,
    sgd_init,
    sgd_update,
    sgd_update_,
)

__all__ = [
    "COMPILE_FASTER_FROM",
    "IGNORED_GROUP_KEYS",
    "OPTIMIZER_KINDS",
    "SUPPORTED",
    "AdamHyper",
    "AdamState",
    "FunctionalOptimizer",
    "FunctionalSpec",
    "SGDHyper",
    "SGDState",
    "State",
    "UpdateKind",
    "adam",
    "adam_apply_",
    "adam_init",
    "adam_update",
    "adam_update_",
    "adamw",
    "adamw_update",
    "adamw_update_",
    "compile_policy",
    "functional_spec",
    "group_hyperparams",
    "group_indices",
    "register_optimizer",
    "sgd",
    "sgd_apply_",
    "sgd_init",
    "sgd_update",
    "sgd_update_",
    "supports_group",
    "update_kind",
]
