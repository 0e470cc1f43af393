"""Registry: what the core knows of each torch.optim class (its functional spec, how it updates).

The stateful shell reads a param group, asks :func:`supports_group` whether the core implements
every option with torch's semantics, picks the keys with :func:`group_hyperparams` and calls
the spec's ``init``/``update_`` with them; state crosses to and from torch's format through
``state_to_dicts``/``state_from_dicts``.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from zero_functional.functional.adam import (
    ADAM_DEFAULTS,
    ADAMW_DEFAULTS,
    AdamHyper,
    AdamState,
    adam_apply_,
    adam_init,
    adam_update_,
    compiled_adam_update_,
)
from zero_functional.functional.factories import State
from zero_functional.functional.sgd import (
    SGD_DEFAULTS,
    SGDHyper,
    SGDState,
    compiled_sgd_update_,
    sgd_apply_,
    sgd_init,
    sgd_update_,
)

__all__ = [
    "IGNORED_GROUP_KEYS",
    "OPTIMIZER_KINDS",
    "SUPPORTED",
    "FunctionalSpec",
    "UpdateKind",
    "choose_update",
    "functional_spec",
    "group_hyperparams",
    "register_optimizer",
    "supports_group",
    "update_kind",
]

# Keys a param group may carry that do not change the update: torch's bookkeeping, LR/momentum
# schedulers' bookkeeping (they write the keys the update reads, which are read fresh each step).
IGNORED_GROUP_KEYS: tuple[str, ...] = (
    "params",
    "param_names",
    "foreach",
    "initial_lr",
    "max_lr",
    "min_lr",
    "base_momentum",
    "max_momentum",
    "base_lr",
)


@dataclass(frozen=True)
class FunctionalSpec:
    """How one torch.optim class maps onto the functional core.

    Attributes:
        name: ``"sgd"``, ``"adam"`` or ``"adamw"``.
        defaults: the param-group keys the update reads, with torch's default for each (used
            when a group lacks one).
        init: ``init(params, **group_hyperparams) -> state``.
        update_: ``update_(params, grads, state, **group_hyperparams)`` in place.
        apply_: ``apply_(params, grads, state, hyper, compile=...)`` in place, ``hyper`` from
            :meth:`record`: ``update_`` without its per-tensor checks of the lists, for a
            caller that built them (the shell).
    """

    name: str
    defaults: Mapping[str, object]
    init: Callable[..., State]
    update_: Callable[..., None]
    apply_: Callable[..., None]

    def record(self, hyper: Mapping[str, object]) -> SGDHyper | AdamHyper:
        """The hyperparameter record of :func:`group_hyperparams`' keywords, for :attr:`apply_`.

        Example:
            >>> import torch
            >>> functional_spec(torch.optim.SGD).record({"lr": 0.5, "momentum": 0.9}).momentum
            0.9
        """
        return (SGDHyper if self.name == "sgd" else AdamHyper)(**hyper)  # type: ignore[arg-type]

    @property
    def hyperparam_keys(self) -> tuple[str, ...]:
        """The param-group keys the update reads."""
        return tuple(self.defaults)

    def state_to_dicts(self, state: State) -> list[dict[str, Tensor]]:
        """Per-param state in torch.optim's format; tensors are shared, not copied.

        SGD: ``{"momentum_buffer": buf}`` once a buffer exists, else ``{}`` (torch stores
        nothing for momentum=0 or before the first step). Adam: ``step``, ``exp_avg``,
        ``exp_avg_sq`` and, with amsgrad, ``max_exp_avg_sq``; a never-stepped param gives
        step 0 and zero moments (torch would have no entry; loading them is equivalent).

        Args:
            state: an ``SGDState`` or ``AdamState`` matching this spec.

        Returns:
            One dict per param.

        Example:
            >>> import torch
            >>> spec = functional_spec(torch.optim.SGD)
            >>> spec.state_to_dicts(SGDState([None, torch.ones(1)]))
            [{}, {'momentum_buffer': tensor([1.])}]
        """
        if isinstance(state, SGDState) != (self.name == "sgd"):
            raise TypeError(f"spec {self.name!r} got an {type(state).__name__}")
        # empty lists (max_exp_avg_sq without amsgrad) and None buffers are not torch's keys
        lists: tuple[Sequence[Tensor | None], ...] = state
        return [
            {k: t for k, ts in zip(state._fields, lists) if ts and (t := ts[i]) is not None}
            for i in range(len(lists[0]))
        ]

    def state_from_dicts(
        self, dicts: Sequence[Mapping[str, Tensor]], params: Sequence[Tensor], **hyper: object
    ) -> State:
        """Inverse of :meth:`state_to_dicts`: build the state from torch-format per-param dicts.

        Tensors are used as-is (no copy). The one exception is Adam's ``step``: torch keeps
        it on the CPU (float32, or float64 under a float64 default dtype) unless fused or
        capturable, so a step that is not a float32 tensor on its param's device is converted
        (a Python number is accepted too). An empty dict gives fresh state for that param.

        Args:
            dicts: one mapping per param, as ``torch.optim.Optimizer.state[p]``.
            params: the params, in the same order.
            **hyper: the group's hyperparams (``amsgrad`` is read for Adam).

        Returns:
            The ``SGDState`` or ``AdamState``.

        Raises:
            ValueError: lengths differ, or amsgrad is on and a stepped param lacks
                ``max_exp_avg_sq``.

        Example:
            >>> import torch
            >>> spec = functional_spec(torch.optim.Adam)
            >>> p = [torch.zeros(2)]
            >>> s = spec.state_from_dicts([{}], p, amsgrad=False)
            >>> s.step[0], s.exp_avg[0]
            (tensor(0.), tensor([0., 0.]))
        """
        if len(dicts) != len(params):
            raise ValueError(
                f"state_from_dicts: got {len(dicts)} state dicts for {len(params)} params; "
                "pass one (possibly empty) dict per param, in the params' order"
            )
        if self.name == "sgd":
            return SGDState(momentum_buffer=[d.get("momentum_buffer") for d in dicts])
        amsgrad = bool(hyper.get("amsgrad", False))
        # Allocate fresh state only where a dict is empty: this runs on every step of the shell.
        empty = [i for i, d in enumerate(dicts) if not d]
        fresh = self.state_to_dicts(adam_init([params[i] for i in empty], amsgrad=amsgrad))
        born = dict(zip(empty, fresh))
        out = AdamState(step=[], exp_avg=[], exp_avg_sq=[], max_exp_avg_sq=[])
        for i, (d, p) in enumerate(zip(dicts, params)):
            d = d or born[i]
            step = d["step"]
            if not isinstance(step, Tensor):
                step = torch.tensor(float(step), dtype=torch.float32, device=p.device)
            elif step.device != p.device or step.dtype != torch.float32:
                step = step.to(device=p.device, dtype=torch.float32)
            out.step.append(step)
            out.exp_avg.append(d["exp_avg"])
            out.exp_avg_sq.append(d["exp_avg_sq"])
            if amsgrad:
                if "max_exp_avg_sq" not in d:
                    raise ValueError(
                        f"state_from_dicts: amsgrad=True but the state of param {i} has no "
                        "'max_exp_avg_sq' (it was stepped with amsgrad=False); torch.optim "
                        "would fail here too: keep amsgrad as it was when the state was made"
                    )
                out.max_exp_avg_sq.append(d["max_exp_avg_sq"])
        return out


def _sgd_init(params: Sequence[Tensor], **hyper: object) -> State:
    return sgd_init(params)


def _adam_init(params: Sequence[Tensor], **hyper: object) -> State:
    return adam_init(params, amsgrad=bool(hyper.get("amsgrad", False)))


_SPECS: dict[type, FunctionalSpec] = {
    torch.optim.SGD: FunctionalSpec(
        "sgd", SGD_DEFAULTS._asdict(), _sgd_init, sgd_update_, sgd_apply_
    ),
    torch.optim.Adam: FunctionalSpec(
        "adam", ADAM_DEFAULTS._asdict(), _adam_init, adam_update_, adam_apply_
    ),
    # AdamW is Adam with decoupled_weight_decay=True in every group (torch's AdamW forces it);
    # the update reads decoupled_weight_decay from the group like Adam's does.
    torch.optim.AdamW: FunctionalSpec(
        "adamw", ADAMW_DEFAULTS._asdict(), _adam_init, adam_update_, adam_apply_
    ),
}
SUPPORTED: tuple[type, ...] = tuple(_SPECS)


def functional_spec(optimizer_class: type) -> FunctionalSpec | None:
    """The spec for a torch.optim class, or ``None`` when the core does not implement it.

    Exact class match: a subclass may override ``step``, so it is not assumed to be the same.

    Args:
        optimizer_class: e.g. ``torch.optim.Adam``.

    Returns:
        The ``FunctionalSpec`` or ``None``.

    Example:
        >>> import torch
        >>> functional_spec(torch.optim.AdamW).name
        'adamw'
        >>> functional_spec(torch.optim.RMSprop) is None
        True
    """
    return _SPECS.get(optimizer_class)


def group_hyperparams(spec: FunctionalSpec, group: Mapping[str, object]) -> dict[str, object]:
    """Pick the keys the update reads from a torch param group, torch's defaults for missing ones.

    Args:
        spec: from :func:`functional_spec`.
        group: a ``torch.optim.Optimizer.param_groups`` entry.

    Returns:
        Keyword arguments for ``spec.init``/``spec.update_``/``spec.update``.

    Example:
        >>> import torch
        >>> spec = functional_spec(torch.optim.SGD)
        >>> group_hyperparams(spec, {"params": [], "lr": 0.1, "momentum": 0.9})["momentum"]
        0.9
    """
    return {k: group.get(k, spec.defaults[k]) for k in spec.hyperparam_keys}


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, Tensor))


def supports_group(spec: FunctionalSpec, group: Mapping[str, object]) -> bool:
    """Whether every option in the group is implemented by the core with torch's semantics.

    False for ``capturable=True``, ``differentiable=True``, tensor ``lr``/``betas``/
    ``weight_decay``, SGD ``fused=True``, ``foreach=True`` together with ``fused=True``, and
    keys neither read by the update nor in :data:`IGNORED_GROUP_KEYS`; the shell then falls
    back to a real torch optimizer.

    Args:
        spec: from :func:`functional_spec`.
        group: a ``torch.optim.Optimizer.param_groups`` entry.

    Returns:
        ``True`` when ``spec.update_(..., **group_hyperparams(spec, group))`` is torch's step.

    Example:
        >>> import torch
        >>> spec = functional_spec(torch.optim.Adam)
        >>> supports_group(spec, {"params": [], "lr": 0.1, "foreach": True})
        True
        >>> supports_group(spec, {"params": [], "lr": 0.1, "capturable": True})
        False
    """
    for key, value in group.items():
        if key in ("differentiable", "capturable"):
            if value:
                return False
        elif key == "fused" and spec.name == "sgd":
            if value:
                return False
        elif key not in spec.hyperparam_keys and key not in IGNORED_GROUP_KEYS:
            return False
    if spec.name != "sgd" and group.get("fused") and group.get("foreach"):
        return False
    hp = group_hyperparams(spec, group)
    # the keys whose default is a number (lr, eps, weight_decay, momentum, dampening)
    if not all(_is_number(hp[k]) for k, v in spec.defaults.items() if _is_number(v)):
        return False
    if spec.name != "sgd":
        betas = hp["betas"]
        if not (
            isinstance(betas, (tuple, list)) and len(betas) == 2 and all(map(_is_number, betas))
        ):
            return False
        if spec.name == "adamw" and not hp["decoupled_weight_decay"]:
            return False
    return True


# compile=None: the graphs where compile_policy says they are faster
_UPDATES: dict[tuple[str, bool | None], Callable[..., None]] = {
    ("sgd", False): sgd_update_,
    ("sgd", True): compiled_sgd_update_,
    ("sgd", None): functools.partial(sgd_update_, compile=None),
    ("adam", False): adam_update_,
    ("adam", True): compiled_adam_update_,
    ("adam", None): functools.partial(adam_update_, compile=None),
}


def choose_update(
    name: Literal["sgd", "adam", "adamw"], *, compile: bool | None = None
) -> Callable[..., None]:
    """The in-place update for a spec's ``name``, with ``compile`` bound.

    The shell calls the result as ``update_(params, grads, state, **group_hyperparams)``; for
    ``"adam"`` and ``"adamw"`` it is :func:`~zero_functional.functional.adam_update_` (AdamW's
    groups pass ``decoupled_weight_decay=True``), as the specs' ``update_``. Nothing is compiled
    until the returned function first runs.

    Args:
        name: ``"sgd"``, ``"adam"`` or ``"adamw"`` (``FunctionalSpec.name``).
        compile: the update's ``compile`` flag: ``True`` everywhere it applies, ``False``
            never, ``None`` where :func:`~zero_functional.functional.compile_policy` says it
            is faster.

    Returns:
        ``sgd_update_`` or ``adam_update_``, or one of them with ``compile`` bound.

    Raises:
        ValueError: an unknown ``name``.

    Example:
        >>> from zero_functional.functional import compiled_adam_update_
        >>> choose_update("adamw", compile=True) is compiled_adam_update_
        True
        >>> choose_update("sgd", compile=False).__name__
        'sgd_update_'
    """
    kind = "adam" if name == "adamw" else name
    if (kind, compile) not in _UPDATES:
        raise ValueError(f"choose_update: unknown optimizer {name!r}; expected sgd, adam or adamw")
    return _UPDATES[(kind, compile)]


UpdateKind = Literal["elementwise", "per_tensor", "closure"]

OPTIMIZER_KINDS: dict[type, UpdateKind] = {
    **{
        cls: "elementwise"
        for cls in (
            torch.optim.SGD,
            torch.optim.Adam,
            torch.optim.AdamW,
            torch.optim.Adamax,
            torch.optim.NAdam,
            torch.optim.RAdam,
            torch.optim.RMSprop,
            torch.optim.Rprop,
            torch.optim.Adagrad,
            torch.optim.Adadelta,
            torch.optim.ASGD,
        )
    },
    torch.optim.LBFGS: "closure",
    **({torch.optim.Adafactor: "per_tensor"} if hasattr(torch.optim, "Adafactor") else {}),
}
"""How each ``torch.optim`` class updates, which decides where it can run (data; extend it with
:func:`register_optimizer`):

* ``"elementwise"``: each element's update reads only that element's parameter, gradient and
  state, plus per-parameter scalars (the step count): it runs on any piece of a tensor, so under
  ``partition="flat"`` and on the pieces of DDP buckets in overlap mode;
* ``"per_tensor"``: the update reads a whole tensor (Adafactor's row and column factors): it needs
  whole-tensor ownership (``partition="sorted_greedy"``);
* ``"closure"``: ``step`` re-evaluates the model through a closure (LBFGS): whole tensors, and
  never inside backward.

A class not listed counts as ``"per_tensor"``, the safe assumption."""


def register_optimizer(optimizer_class: type, kind: UpdateKind) -> None:
    """Declare how ``optimizer_class`` updates (see :data:`OPTIMIZER_KINDS`).

    Example:
        >>> class MySGD(torch.optim.SGD):
        ...     pass
        >>> update_kind(MySGD)
        'per_tensor'
        >>> register_optimizer(MySGD, "elementwise")
        >>> update_kind(MySGD)
        'elementwise'
    """
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise TypeError(
            f"register_optimizer takes a torch.optim.Optimizer subclass, got {optimizer_class!r}"
        )
    if kind not in ("elementwise", "per_tensor", "closure"):
        raise ValueError(f"kind must be 'elementwise', 'per_tensor' or 'closure', got {kind!r}")
    OPTIMIZER_KINDS[optimizer_class] = kind


def update_kind(optimizer_class: type) -> UpdateKind:
    """How ``optimizer_class`` updates: its registered kind, ``"per_tensor"`` if unregistered.

    Exact class match, as :func:`functional_spec`: a subclass may override ``step``.

    Example:
        >>> update_kind(torch.optim.RMSprop), update_kind(torch.optim.LBFGS)
        ('elementwise', 'closure')
    """
    return OPTIMIZER_KINDS.get(optimizer_class, "per_tensor")
