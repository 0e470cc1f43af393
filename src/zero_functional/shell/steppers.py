"""How one rank updates the pieces it owns: a stepper per optimizer class, one interface.

The shell hands a stepper, per parameter group, the group (hyperparameters read *now*, so
schedulers and user edits apply), the owned pieces' views, their gradients and their state dicts
(the shell's own: ``ZeroRedundancyOptimizer.state``); the stepper updates them in place. Every
stepper answers the same questions for a group (:meth:`Stepper.for_group`: its class's stepper;
:attr:`~Stepper.tensor_keys`, :attr:`~Stepper.blockwise`, :attr:`~Stepper.functional`), so no
caller asks which kind it holds:

* :class:`FunctionalStepper`: SGD, Adam and AdamW through :mod:`zero_functional.functional`;
* :class:`PieceViewStepper`: any other elementwise class, a real instance of it stepping detached
  views of the pieces (in overlap mode too);
* :class:`WholeParamStepper`: torch's own arrangement, one instance over this rank's whole
  parameters (whole-tensor ownership after backward): closures and step keywords pass through;
* :class:`PerClassStepper`: a class per parameter group, each group through its class's stepper.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Container, Mapping, MutableMapping, Sequence
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

__all__ = [
    "FunctionalStepper",
    "LocalView",
    "PerClassStepper",
    "PieceViewStepper",
    "Stepper",
    "WholeParamStepper",
    "choose_stepper",
    "converted_state",
    "hyperparameters",
    "loaded_group",
    "probe_state",
    "saved_group",
    "state_schema",
    "state_schemas",
]

StateDicts = list[dict[str, Any]]


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group without its ``params``: what a stepper copies in before each step."""
    return {k: v for k, v in group.items() if k != "params"}


class Stepper:
    """How pieces of one class's parameters are updated; what the shell asks of any stepper.

    Attributes:
        whole: Steps whole parameters itself (:meth:`step_whole`), not pieces.
        local: The real instance that steps, if any (``ZeroRedundancyOptimizer.optim``).
    """

    whole = False
    local: Optimizer | None = None

    def for_group(self, group: Mapping[str, Any]) -> Stepper:
        """The stepper of ``group``'s class (itself, but for a class per group)."""
        return self

    @property
    def tensor_keys(self) -> dict[str, torch.dtype]:
        """The hyperparameters its class keeps as 0-d tensors (torchao's ``lr``), with dtypes."""
        return {}

    @property
    def blockwise(self) -> Optimizer | None:
        """The instance, where its class quantizes its state per block (torchao's low-bit)."""
        return None

    @property
    def functional(self) -> bool:
        """Whether it runs the functional core (whose state keeps ``step`` as fp32)."""
        return False

    def step_pieces(
        self,
        group: Mapping[str, Any],
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        states: StateDicts,
        numels: Sequence[int] | None = None,
    ) -> None:
        """Update ``params`` and ``states`` (one dict per param, possibly empty) in place;
        ``numels``: each piece's whole parameter's size, where a class decides its state on
        the whole parameter (torchao's low-bit state)."""
        raise RuntimeError(
            f"update_owned needs an optimizer that runs on pieces; this one runs "
            f"{type(self.local).__name__} over whole parameters: call step()"
        )

    def step_whole(
        self, groups: Sequence[dict[str, Any]], closure: Callable[[], float] | None, **kwargs: Any
    ) -> float | None:
        """Step the whole parameters (:class:`WholeParamStepper` only)."""
        raise RuntimeError("this optimizer steps pieces: step_pieces")


class FunctionalStepper(Stepper):
    """The functional core's in-place update over torch's state dicts.

    ``compile`` picks the kernel (the spec's ``apply_``): ``None`` compiles only where it
    measures faster, ``True`` wherever it applies (eager, with one warning, where compiling
    fails), ``False`` never.
    """

    def __init__(self, spec: FunctionalSpec, compile: bool | None = None) -> None:
        self.spec = spec
        self.compile = compile

    @property
    def functional(self) -> bool:
        return True

    def step_pieces(
        self,
        group: Mapping[str, Any],
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        states: StateDicts,
        numels: Sequence[int] | None = None,
    ) -> None:
        """One step of the functional optimizer over ``params`` (see :class:`Stepper`)."""
        if not params:
            return
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
    """A real ``optimizer_class`` instance stepping detached views of the pieces.

    Each call builds fresh leaf tensors sharing storage with the pieces (so the class's
    in-place update writes the parameters), sets their ``.grad``, links the instance's
    ``state`` to the shell's dicts and its only group to the group's hyperparameters now,
    steps, and lets go of all of it.
    """

    def __init__(self, local: Optimizer, defaults: Mapping[str, Any]) -> None:
        if len(local.param_groups) != 1:
            raise ValueError("PieceViewStepper takes an instance built with one parameter group")
        self.local = local
        self.defaults = dict(defaults)
        self._tensor_keys = tensor_keys(local)

    @property
    def tensor_keys(self) -> dict[str, torch.dtype]:
        return dict(self._tensor_keys)

    @property
    def blockwise(self) -> Optimizer | None:
        return self.local if update_block(type(self.local)) > 1 else None

    def step_pieces(
        self,
        group: Mapping[str, Any],
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        states: StateDicts,
        numels: Sequence[int] | None = None,
    ) -> None:
        """One step of the instance over views of ``params`` (see :class:`Stepper`); a class
        with quantization blocks decides fresh state on the whole parameters of ``numels``
        (:func:`lowbit_state`), not on the pieces."""
        if not params:
            return
        views = []
        for p, g in zip(params, grads, strict=True):
            view = p.detach()
            view.grad = g.detach()
            views.append(view)
        local = self.local
        assert local is not None
        if numels is not None and self.blockwise is not None:
            for view, s, n in zip(views, states, numels, strict=True):
                if not s:
                    s.update(lowbit_state(local, group, view, n))
        fresh = [(view, s) for view, s in zip(views, states) if not s]
        if fresh:
            _initial_state(type(local), group, fresh, self.defaults)
        local.param_groups[0] = {**instance_hyper(self._tensor_keys, group), "params": views}
        local.state = defaultdict(dict, zip(views, states))
        try:
            with torch.no_grad():
                local.step()
        finally:
            # the instance keeps its own kinds (torchao's tensor lr): a stepper built on it
            # later (a reshard) reads them from it
            local.param_groups[0] = {**instance_hyper(self._tensor_keys, group), "params": []}
            local.state = defaultdict(dict)


class WholeParamStepper(Stepper):
    """torch's own arrangement: one instance over this rank's whole parameters, whose
    ``state`` is the shell's mapping itself, so that a closure (LBFGS) or step keywords reach
    ``optimizer_class.step`` unchanged."""

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
        self.local = local
        self._tensor_keys = tensor_keys(local)
        # a rank may own nothing of a group: the placeholder only got the constructor through
        for lg, ps in zip(local.param_groups, owned):
            lg["params"] = list(ps)
        for p, s in local.state.items():  # state a constructor made (Adagrad's sum)
            if p is not placeholder and not state.get(p):
                state[p] = s
        local.state = state  # type: ignore[assignment]

    @property
    def tensor_keys(self) -> dict[str, torch.dtype]:
        return dict(self._tensor_keys)

    @property
    def blockwise(self) -> Optimizer | None:
        return self.local if update_block(type(self.local)) > 1 else None

    def step_whole(
        self, groups: Sequence[dict[str, Any]], closure: Callable[[], float] | None, **kwargs: Any
    ) -> float | None:
        """``optimizer_class.step`` with the shell's hyperparameters; they are copied back."""
        local = self.local
        assert local is not None
        for g, lg in zip(groups, local.param_groups, strict=True):
            lg.update(instance_hyper(self._tensor_keys, g))
        loss = local.step(closure, **kwargs) if closure is not None else local.step(**kwargs)
        for g, lg in zip(groups, local.param_groups, strict=True):
            # the shell keeps a number where the instance keeps a tensor (torchao's lr)
            g.update(
                {
                    k: v
                    for k, v in hyperparameters(lg).items()
                    if k not in self._tensor_keys or isinstance(g.get(k), Tensor)
                }
            )
        return cast("float | None", loss)


class PerClassStepper(Stepper):
    """Each group through the stepper of its class (its ``"optimizer_class"`` name)."""

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
    """Per class of ``param_groups`` (a class per group): the functional core where it covers
    every group of the class, else a real instance over piece views (the constructor's keyword
    ``defaults`` reach ``default``'s only).

    Example:
        >>> groups = [{"params": [torch.zeros(2, 2)], "optimizer_class": "torch.optim.Muon"},
        ...           {"params": [torch.zeros(2)], "lr": 0.1, "optimizer_class": "torch.optim.AdamW"}]
        >>> stepper = per_class_stepper(groups, torch.optim.AdamW, False, {})
        >>> sorted((k, type(v).__name__) for k, v in stepper.steppers.items())
        [('torch.optim.AdamW', 'FunctionalStepper'), ('torch.optim.Muon', 'PieceViewStepper')]
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
    """How this rank updates its pieces: the functional core where ``spec`` covers the class;
    else, where this rank owns ``whole`` parameters (after backward), a real instance of the
    class over them sharing ``state``; else a real instance over views of the pieces. With a
    class per group, each group through its class (:func:`per_class_stepper`)."""
    if is_mixed(param_groups):
        return per_class_stepper(param_groups, type(probe), compile, defaults)
    if spec is not None:
        return FunctionalStepper(spec, compile)
    if whole:
        owned: list[list[Tensor]] = []
        start = 0
        for g in param_groups:
            owned.append([p for i, p in enumerate(g["params"]) if start + i in own])
            start += len(g["params"])
        return WholeParamStepper(type(probe), param_groups, owned, state, dict(defaults))
    return PieceViewStepper(probe, dict(defaults))


def converted_state(
    stepper: Stepper, group: Mapping[str, Any], state: Mapping[str, Any], numel: int
) -> tuple[dict[str, Any], str | None]:
    """A loaded piece state of a parameter of ``numel`` elements as ``group``'s class keeps
    it, and how it was converted (``None``: as it was): quantized state where the class keeps
    fp32 is dequantized; fp32 moments where a low-bit class quantizes the whole parameter are
    quantized (torchao's ``copy_`` into its zero state quantizes).

    Example:
        >>> from torchao.optim import AdamW8bit
        >>> stepper = PieceViewStepper(AdamW8bit([torch.zeros(1)]), {})
        >>> state = {"step": torch.tensor(1.0), "exp_avg": torch.ones(4096), "exp_avg_sq": torch.ones(4096)}
        >>> new, how = converted_state(stepper, {}, state, 4096)
        >>> type(new["exp_avg"]).__name__, how
        ('OptimState8bit', 'quantized')
        >>> back, how = converted_state(PieceViewStepper(torch.optim.AdamW([torch.zeros(1)]), {}), {}, new, 4096)
        >>> type(back["exp_avg"]).__name__, torch.equal(back["exp_avg"], torch.ones(4096)), how
        ('Tensor', True, 'dequantized')
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


def saved_group(stepper: Stepper, group: Mapping[str, Any]) -> dict[str, Any]:
    """``group`` as a state dict carries it: a hyperparameter its class keeps as a 0-d tensor
    (torchao's ``lr``) as one, so that a plain instance of the class loads it.

    Example:
        >>> local = torch.optim.SGD([torch.zeros(1)], lr=torch.tensor(0.1))
        >>> saved_group(PieceViewStepper(local, {}), {"params": [0], "lr": 0.5})
        {'lr': tensor(0.5000), 'params': [0]}
    """
    keys = stepper.for_group(group).tensor_keys
    return {**instance_hyper(keys, group), "params": group["params"]}


def loaded_group(
    stepper: Stepper, group: Mapping[str, Any], saved: Mapping[str, Any]
) -> dict[str, Any]:
    """``saved``'s hyperparameters as the shell's ``group`` keeps them: a 0-d tensor of a key
    the class keeps as a tensor becomes a number where ``group`` holds a number.

    Example:
        >>> local = torch.optim.SGD([torch.zeros(1)], lr=torch.tensor(0.1))
        >>> loaded_group(PieceViewStepper(local, {}), {"lr": 0.1}, {"lr": torch.tensor(0.5)})
        {'lr': 0.5}
    """
    keys = stepper.for_group(group).tensor_keys
    return {
        k: v.item()
        if k in keys and isinstance(v, Tensor) and not isinstance(group.get(k), Tensor)
        else v
        for k, v in hyperparameters(saved).items()
    }


def lowbit_state(
    local: Optimizer, group: Mapping[str, Any], piece: Tensor, numel: int
) -> dict[str, Tensor]:
    """The fresh state torchao's low-bit ``local`` makes for ``piece`` of a parameter of
    ``numel`` elements: quantized (per block of ``local.block_size`` elements) where the
    *whole* parameter is quantized, fp32 where it is not, whatever the piece's size (torchao
    applies its rule to what it is given: a small piece would silently fall back to fp32,
    pytorch/ao#4912, bitsandbytes#2080).

    Raises:
        ValueError: A quantized parameter's piece that is not whole blocks (a cut that splits
            a block: ``"flat"`` cuts on blocks, :func:`~zero_functional.core.ownership.block_bounds`).

    Example:
        >>> from torchao.optim import AdamW8bit
        >>> local = AdamW8bit([torch.zeros(1)])
        >>> state = lowbit_state(local, local.param_groups[0], torch.zeros(512), 8192)
        >>> type(state["exp_avg"]).__name__, type(state["exp_avg_sq"]).__name__
        ('OptimState8bit', 'OptimState8bit')
        >>> type(lowbit_state(local, {}, torch.zeros(4096), 4100)["exp_avg"]).__name__
        'Tensor'
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
    """The hyperparameters ``local``'s group holds as 0-d tensors (torchao's ``lr``), with
    their dtypes.

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
    """``group``'s hyperparameters as the instance takes them: a number where the instance
    keeps a 0-d tensor (``keys``, :func:`tensor_keys`) becomes one.

    Example:
        >>> instance_hyper({"lr": torch.float32}, {"params": [], "lr": 0.5})
        {'lr': tensor(0.5000)}
    """
    # compat: torchao's low-bit optimizers refuse a number lr ("lr was changed to a non-Tensor")
    return {
        k: torch.tensor(v, dtype=keys[k]) if k in keys and not isinstance(v, Tensor) else v
        for k, v in hyperparameters(group).items()
    }


def _initial_state(
    optimizer_class: type[Optimizer],
    group: Mapping[str, Any],
    fresh: Sequence[tuple[Tensor, dict[str, Any]]],
    defaults: Mapping[str, Any],
) -> None:
    """Fill empty state dicts the way ``optimizer_class``'s constructor would (Adagrad makes
    its ``sum`` there, not in ``step``); classes that make state lazily leave them empty."""
    # compat: Adagrad's constructor fills ``sum`` from its own initial_accumulator_value
    # argument, not from the group's, so the constructor gets the user's defaults too
    born = optimizer_class(
        [{**hyperparameters(group), "params": [t for t, _ in fresh]}], **defaults
    )
    for t, s in fresh:
        s.update(born.state.get(t, {}))


def probe_state(
    optimizer_class: type[Optimizer],
    group: Mapping[str, Any],
    defaults: Mapping[str, Any],
    shape: tuple[int, ...] = (2,),
) -> dict[str, Any] | None:
    """The state one step of ``optimizer_class`` makes for a CPU probe parameter of ``shape``
    (2 elements by default; a per-tensor class's own shape, as Muon takes matrices only) with
    ``group``'s options (gradient ones): which keys a state has, of which type, dtype and
    shape. ``None`` when a probe step cannot tell (a class that needs a closure, another
    device, or other shapes).

    Example:
        >>> sorted(probe_state(torch.optim.Adam, {"lr": 0.1}, {}))
        ['exp_avg', 'exp_avg_sq', 'step']
        >>> probe_state(torch.optim.Muon, {"lr": 0.1}, {}, (3, 2))["momentum_buffer"].shape
        torch.Size([3, 2])
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


def state_schema(
    optimizer_class: type[Optimizer], group: Mapping[str, Any], defaults: Mapping[str, Any]
) -> dict[str, str] | None:
    """The state keys one step of ``optimizer_class`` makes with ``group``'s options, each
    ``"elementwise"`` or ``"scalar"``: what a loaded state must look like. ``None`` when a
    probe step cannot tell (a class that needs a closure or another device)."""
    state = probe_state(optimizer_class, group, defaults)
    if state is None:
        return None
    return {key: "elementwise" if is_elementwise(v, 2) else "scalar" for key, v in state.items()}


def state_schemas(
    optimizer_class: type[Optimizer],
    groups: Sequence[Mapping[str, Any]],
    defaults: Mapping[str, Any],
) -> list[dict[str, str] | None]:
    """Per group, :func:`state_schema` where its class (``optimizer_class``, or the group's
    own) is elementwise, else ``None`` (no per-element state to check a loaded one against).

    Example:
        >>> state_schemas(torch.optim.SGD, [{"lr": 0.1, "momentum": 0.9}], {})
        [{'momentum_buffer': 'elementwise'}]
        >>> state_schemas(torch.optim.LBFGS, [{"lr": 1.0}], {})
        [None]
    """
    out: list[dict[str, str] | None] = []
    for g in groups:
        cls = group_class(g, optimizer_class)
        own = GROUP_CLASS_KEY in g and cls is not optimizer_class
        elementwise = update_kind(cls) == "elementwise"
        out.append(state_schema(cls, g, {} if own else defaults) if elementwise else None)
    return out


class LocalView:
    """torch's ``optim`` attribute: this rank's share as a local optimizer would show it.

    ``param_groups`` hold, per group, the hyperparameters and the parameters this rank owns
    (all or part of); ``state`` is this rank's state. For an optimizer class that runs as a
    real instance over whole parameters, ``ZeroRedundancyOptimizer.optim`` is that instance.
    """

    def __init__(self, param_groups: list[dict[str, Any]], state: Mapping[Tensor, Any]) -> None:
        self.param_groups = param_groups
        self.state = state

    @classmethod
    def of(
        cls,
        param_groups: Sequence[Mapping[str, Any]],
        own: Container[int],
        state: Mapping[Tensor, Any],
    ) -> LocalView:
        """The view of the parameters whose global index is in ``own``.

        Example:
            >>> import torch
            >>> w, b = torch.zeros(2), torch.zeros(1)
            >>> view = LocalView.of([{"lr": 0.1, "params": [w, b]}], {1}, {})
            >>> [p is b for p in view.param_groups[0]["params"]], view.param_groups[0]["lr"]
            ([True], 0.1)
        """
        groups: list[dict[str, Any]] = []
        start = 0
        for g in param_groups:
            owned = [p for i, p in enumerate(g["params"]) if start + i in own]
            groups.append({**hyperparameters(g), "params": owned})
            start += len(g["params"])
        return cls(groups, state)
