"""Steppers: how one rank updates the pieces it owns, one interface per optimizer class.

A stepper updates the pieces of a group in place, with its hyperparameters read *now*; every
stepper answers the same questions (:meth:`Stepper.for_group`), so no caller asks its kind.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Container, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from zero_functional.core.blockwise import is_blockwise
from zero_functional.core.classes import group_class, is_mixed
from zero_functional.core.piece_state import is_elementwise
from zero_functional.functional import (
    FunctionalSpec,
    functional_spec,
    group_hyperparams,
    supports_group,
    update_kind,
)
from zero_functional.functional.lowbit import quantized
from zero_functional.functional.registry import GROUP_CLASS_KEY, optimizer_name, update_block

StateDicts = list[dict[str, Any]]


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group without its ``params``.

    Example:
        >>> hyperparameters({"params": [], "lr": 0.1})
        {'lr': 0.1}
    """
    return {k: v for k, v in group.items() if k != "params"}


class Stepper:
    """What the shell asks of any stepper; this base steps nothing.

    Attributes:
        whole: Steps whole parameters itself (:meth:`step_whole`), not pieces.
        local: The real instance that steps, if any (``ZeroRedundancyOptimizer.optim``).
        tensor_keys: The hyperparameters its class keeps as 0-d tensors (torchao's ``lr``), with
            dtypes (read it, do not write it).
        functional: Runs the functional core (whose state keeps ``step`` as fp32).
    """

    whole = False
    local: Optimizer | None = None
    tensor_keys: dict[str, torch.dtype] = {}
    functional = False

    def for_group(self, group: Mapping[str, Any]) -> Stepper:
        """The stepper of ``group``'s class (itself, but for a class per group)."""
        return self

    @property
    def blockwise(self) -> Optimizer | None:
        """The instance, where its class quantizes its state per block (torchao's low-bit)."""
        local = self.local
        return local if local is not None and update_block(type(local)) > 1 else None

    def step_pieces(
        self,
        group: Mapping[str, Any],
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        states: StateDicts,
        numels: Sequence[int] | None = None,
    ) -> None:
        """Update ``params`` and ``states`` in place (``numels``: each piece's parameter's size)."""
        raise RuntimeError("this optimizer steps whole parameters: step_whole")

    def step_whole(
        self, groups: Sequence[dict[str, Any]], closure: Callable[[], float] | None, **kwargs: Any
    ) -> float | None:
        """Step the whole parameters (:class:`WholeParamStepper` only)."""
        raise RuntimeError("this optimizer steps pieces: step_pieces")


class FunctionalStepper(Stepper):
    """SGD, Adam and AdamW: the functional core's in-place update over torch's state dicts."""

    functional = True

    def __init__(self, spec: FunctionalSpec, compile: bool | None = None) -> None:
        self.spec = spec
        self.compile = compile

    def step_pieces(
        self,
        group: Mapping[str, Any],
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        states: StateDicts,
        numels: Sequence[int] | None = None,
    ) -> None:
        spec, hyper = self.spec, group_hyperparams(self.spec, group)
        # the state's tensors are the dicts' own (fresh where a dict is empty): the update
        # changes them in place, and only what it made anew is written back
        state = spec.state_from_dicts(states, params, **hyper)
        spec.apply_(params, grads, state, spec.record(hyper), compile=self.compile)
        for s, d in zip(states, spec.state_to_dicts(state)):
            for key, value in d.items():
                if s.get(key) is not value:
                    s[key] = value


class PieceViewStepper(Stepper):
    """A real instance of the class stepping views of the pieces, with the shell's state dicts
    (``local`` has one parameter group, given the pieces at each step)."""

    def __init__(self, local: Optimizer, defaults: Mapping[str, Any]) -> None:
        self.local: Optimizer = local
        self.defaults = dict(defaults)
        self.tensor_keys = tensor_keys(local)

    def step_pieces(
        self,
        group: Mapping[str, Any],
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        states: StateDicts,
        numels: Sequence[int] | None = None,
    ) -> None:
        views = []
        for p, g in zip(params, grads, strict=True):
            view = p.detach()
            view.grad = g.detach()
            views.append(view)
        local = self.local
        if numels is not None and self.blockwise is not None:
            for view, s, n in zip(views, states, numels, strict=True):
                if not s:
                    s.update(lowbit_state(local, group, view, n))
        fresh = [(view, s) for view, s in zip(views, states) if not s]
        if fresh:  # as the class's constructor fills them (Adagrad's ``sum``)
            # compat: Adagrad's constructor fills ``sum`` from its own initial_accumulator_value
            # argument, not from the group's, so the constructor gets the user's defaults too
            own = {**hyperparameters(group), "params": [t for t, _ in fresh]}
            born = type(local)([own], **self.defaults)
            for t, s in fresh:
                s.update(born.state.get(t, {}))
        local.param_groups[0] = {**instance_hyper(self.tensor_keys, group), "params": views}
        local.state = defaultdict(dict, zip(views, states))
        try:
            with torch.no_grad():
                local.step()
        finally:
            # the instance keeps its own kinds (torchao's tensor lr) for a later stepper
            local.param_groups[0] = {**instance_hyper(self.tensor_keys, group), "params": []}
            local.state = defaultdict(dict)


class WholeParamStepper(Stepper):
    """torch's arrangement: one instance over this rank's whole parameters (closures pass)."""

    whole = True

    def __init__(
        self,
        optimizer_class: type[Optimizer],
        groups: Sequence[Mapping[str, Any]],
        owned: Sequence[Sequence[Tensor]],
        state: MutableMapping[Tensor, Any],
        defaults: Mapping[str, Any],
    ) -> None:
        placeholder = torch.nn.Parameter(torch.zeros(1))
        local_groups = [
            {**hyperparameters(g), "params": list(ps) or [placeholder]}
            for g, ps in zip(groups, owned, strict=True)
        ]
        local = optimizer_class(local_groups, **defaults)
        self.local: Optimizer = local
        self.tensor_keys = tensor_keys(local)
        # a rank may own nothing of a group: the placeholder only got the constructor through
        for lg, ps in zip(local.param_groups, owned):
            lg["params"] = list(ps)
        for p, s in local.state.items():  # state a constructor made (Adagrad's sum)
            if p is not placeholder and not state.get(p):
                state[p] = s
        local.state = state  # type: ignore[assignment]

    def step_whole(
        self, groups: Sequence[dict[str, Any]], closure: Callable[[], float] | None, **kwargs: Any
    ) -> float | None:
        """``optimizer_class.step`` with the shell's hyperparameters; they are copied back."""
        local, keys = self.local, self.tensor_keys
        for g, lg in zip(groups, local.param_groups, strict=True):
            lg.update(instance_hyper(keys, g))
        loss = local.step(closure, **kwargs) if closure is not None else local.step(**kwargs)
        for g, lg in zip(groups, local.param_groups, strict=True):
            # the shell keeps a number where the instance keeps a tensor (torchao's lr)
            new = hyperparameters(lg).items()
            g.update({k: v for k, v in new if k not in keys or isinstance(g.get(k), Tensor)})
        return cast("float | None", loss)


class PerClassStepper(Stepper):
    """Each group through the stepper of its class (:func:`per_class_stepper`)."""

    def __init__(self, steppers: Mapping[str, Stepper]) -> None:
        self.steppers = dict(steppers)
        self._none = Stepper()  # a group added since: not stepped yet

    def for_group(self, group: Mapping[str, Any]) -> Stepper:
        return self.steppers.get(group.get(GROUP_CLASS_KEY, ""), self._none)

    def step_pieces(
        self,
        group: Mapping[str, Any],
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        states: StateDicts,
        numels: Sequence[int] | None = None,
    ) -> None:
        self.steppers[group[GROUP_CLASS_KEY]].step_pieces(group, params, grads, states, numels)


def per_class_stepper(
    param_groups: Sequence[Mapping[str, Any]],
    default: type[Optimizer],
    compile: bool | None,
    defaults: Mapping[str, Any],
) -> PerClassStepper:
    """A stepper per class of ``param_groups`` (``defaults`` reach ``default``'s only).

    Example:
        >>> groups = [{"params": [torch.zeros(2, 2)], "optimizer_class": "torch.optim.Muon"},
        ...           {"params": [torch.zeros(2)], "optimizer_class": "torch.optim.AdamW"}]
        >>> sorted(per_class_stepper(groups, torch.optim.AdamW, False, {}).steppers)
        ['torch.optim.AdamW', 'torch.optim.Muon']
    """
    by_class: dict[type[Optimizer], list[Mapping[str, Any]]] = {}
    for g in param_groups:
        by_class.setdefault(group_class(g, default), []).append(g)
    steppers: dict[str, Stepper] = {}
    for cls, groups in by_class.items():
        spec = functional_spec(cls)
        if spec is not None and all(supports_group(spec, g) for g in groups):
            steppers[optimizer_name(cls)] = FunctionalStepper(spec, compile)
            continue
        # an instance over one of its own parameters (a class may refuse other shapes)
        own = {**hyperparameters(groups[0]), "params": list(groups[0]["params"])[:1]}
        local = cls([own], **(defaults if cls is default else {}))
        local.param_groups[0]["params"] = []
        steppers[optimizer_name(cls)] = PieceViewStepper(local, defaults if cls is default else {})
    return PerClassStepper(steppers)


def choose_stepper(
    spec: FunctionalSpec | None,
    compile: bool | None,
    probe: Optimizer,
    whole: bool,
    param_groups: list[dict[str, Any]],
    own: Container[int],
    state: Any,
    defaults: Mapping[str, Any],
) -> Stepper:
    """How this rank updates its pieces: the functional core, or a real instance over its
    ``whole`` parameters, or over views of its pieces; per class, :func:`per_class_stepper`."""
    if is_mixed(param_groups):
        return per_class_stepper(param_groups, type(probe), compile, defaults)
    if spec is not None:
        return FunctionalStepper(spec, compile)
    if whole:
        owned = owned_params(param_groups, own)
        return WholeParamStepper(type(probe), param_groups, owned, state, dict(defaults))
    return PieceViewStepper(probe, dict(defaults))


def owned_params(groups: Sequence[Mapping[str, Any]], own: Container[int]) -> list[list[Tensor]]:
    """Per group, its parameters whose global index is in ``own``.

    Example:
        >>> w, b = torch.zeros(2), torch.zeros(1)
        >>> [len(ps) for ps in owned_params([{"params": [w]}, {"params": [b]}], {1})]
        [0, 1]
    """
    out: list[list[Tensor]] = []
    start = 0
    for g in groups:
        out.append([p for i, p in enumerate(g["params"]) if start + i in own])
        start += len(g["params"])
    return out


def converted_state(
    stepper: Stepper, group: Mapping[str, Any], state: Mapping[str, Any], numel: int
) -> tuple[dict[str, Any], str | None]:
    """A loaded piece state as ``group``'s class keeps it, and how it was converted.

    Example:
        >>> from torchao.optim import AdamW8bit
        >>> stepper = PieceViewStepper(AdamW8bit([torch.zeros(1)]), {})
        >>> state = {"exp_avg": torch.ones(4096), "exp_avg_sq": torch.ones(4096)}
        >>> new, how = converted_state(stepper, {}, state, 4096)
        >>> type(new["exp_avg"]).__name__, how
        ('OptimState8bit', 'quantized')
    """
    local = stepper.for_group(group).blockwise
    out, how = dict(state), None
    if local is None:
        for key, value in state.items():
            if is_blockwise(value):
                out[key], how = value.dequantize(), "dequantized"
        return out, how
    block = int(getattr(local, "block_size", 1))  # torchao's instance attribute
    moments = [k for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if k in state]
    plain = [k for k in moments if isinstance(state[k], Tensor) and not is_blockwise(state[k])]
    if plain and quantized(numel, block):
        piece = cast(Tensor, state[plain[0]]).detach()
        zeros = lowbit_state(local, {**group, "amsgrad": "max_exp_avg_sq" in state}, piece, numel)
        for key in plain:
            out[key] = zeros[key].copy_(cast(Tensor, state[key]).detach())
        how = "quantized"
    return out, how


def lowbit_state(
    local: Optimizer, group: Mapping[str, Any], piece: Tensor, numel: int
) -> dict[str, Tensor]:
    """The fresh state torchao's low-bit ``local`` makes for ``piece`` of a parameter of
    ``numel`` elements: quantized where the *whole* parameter is, whatever the piece's size
    (torchao would decide on the piece: pytorch/ao#4912); ValueError where a quantized piece is not
    whole blocks.

    Example:
        >>> from torchao.optim import AdamW8bit
        >>> local = AdamW8bit([torch.zeros(1)])
        >>> type(lowbit_state(local, {}, torch.zeros(512), 8192)["exp_avg"]).__name__
        'OptimState8bit'
    """
    block = int(getattr(local, "block_size", 1))  # torchao's instance attribute
    whole_quantized = quantized(numel, block)
    if whole_quantized and piece.numel() % block:
        raise ValueError(
            f"a piece of {piece.numel()} elements of a parameter of {numel} is not whole "
            f"blocks of {block}: {type(local).__name__} quantizes its state per block counted "
            "from the parameter's start, so its pieces must start and stop on one"
        )

    def zeros(signed: bool) -> Tensor:
        if not whole_quantized:
            return torch.zeros_like(piece)
        # torchao's own hook for a zero-filled quantized state of its class
        return cast(Tensor, type(local)._subclass_zeros(piece, signed, block))  # type: ignore[attr-defined]

    state = {"step": torch.tensor(0.0), "exp_avg": zeros(True), "exp_avg_sq": zeros(False)}
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = zeros(False)
    return state


def tensor_keys(local: Optimizer) -> dict[str, torch.dtype]:
    """The hyperparameters ``local``'s group holds as 0-d tensors (torchao's ``lr``), with dtypes.

    Example:
        >>> tensor_keys(torch.optim.SGD([torch.zeros(1)], lr=torch.tensor(0.1)))
        {'lr': torch.float32}
    """
    return {
        k: v.dtype
        for k, v in local.param_groups[0].items()
        if isinstance(v, Tensor) and v.dim() == 0
    }


def instance_hyper(keys: Mapping[str, torch.dtype], group: Mapping[str, Any]) -> dict[str, Any]:
    """``group``'s hyperparameters as the instance takes them: a 0-d tensor for each of ``keys``.

    Example:
        >>> instance_hyper({"lr": torch.float32}, {"params": [], "lr": 0.5})
        {'lr': tensor(0.5000)}
    """
    # compat: torchao's low-bit optimizers refuse a number lr ("lr was changed to a non-Tensor")
    return {
        k: torch.tensor(v, dtype=keys[k]) if k in keys and not isinstance(v, Tensor) else v
        for k, v in hyperparameters(group).items()
    }


def probe_state(
    optimizer_class: type[Optimizer],
    group: Mapping[str, Any],
    defaults: Mapping[str, Any],
    shape: tuple[int, ...] = (2,),
) -> dict[str, Any] | None:
    """The state one step of ``optimizer_class`` makes for a CPU probe (``None``: cannot tell).

    Example:
        >>> sorted(probe_state(torch.optim.Adam, {"lr": 0.1}, {}))
        ['exp_avg', 'exp_avg_sq', 'step']
    """
    probe = torch.nn.Parameter(torch.zeros(shape))
    probe.grad = torch.ones(shape)
    try:
        opt = optimizer_class([{**hyperparameters(group), "params": [probe]}], **defaults)
        with torch.no_grad():
            opt.step()
    except Exception:  # the class cannot step a CPU probe this way: no schema, generic checks
        return None
    return dict(opt.state[probe])


def state_schemas(
    optimizer_class: type[Optimizer],
    groups: Sequence[Mapping[str, Any]],
    defaults: Mapping[str, Any],
) -> list[dict[str, str] | None]:
    """Per group, the state keys its class makes, ``"elementwise"`` or ``"scalar"`` (``None``:
    not elementwise, or cannot tell): what a loaded state must look like.

    Example:
        >>> state_schemas(torch.optim.SGD, [{"lr": 0.1, "momentum": 0.9}], {})
        [{'momentum_buffer': 'elementwise'}]
    """
    out: list[dict[str, str] | None] = []
    for g in groups:
        cls = group_class(g, optimizer_class)
        own = GROUP_CLASS_KEY in g and cls is not optimizer_class
        state = None
        if update_kind(cls) == "elementwise":
            state = probe_state(cls, g, {} if own else defaults)
        kinds = {
            k: "elementwise" if is_elementwise(v, 2) else "scalar" for k, v in (state or {}).items()
        }
        out.append(None if state is None else kinds)
    return out


@dataclass
class LocalView:
    """torch's ``optim`` attribute: per group the parameters this rank owns, and its state."""

    param_groups: list[dict[str, Any]]
    state: Mapping[Tensor, Any]
