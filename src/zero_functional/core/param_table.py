"""The optimizer's parameters as one frozen table (pure): order, index, group, spans, keys.

Built once per ownership (torch keeps ``_param_to_index``, Megatron-LM a ``BufferKey``) for
every collaborator that asks which parameter is where."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torch import Tensor, nn

from zero_functional.core._validate import first_of, prefix_sums


class BufferKey(NamedTuple):
    """The (device, dtype) of a parameter: parameters of one key can share a flat buffer."""

    device: str
    dtype: str


def buffer_key(t: Tensor) -> BufferKey:
    """The buffer key of tensor ``t``.

    Example:
        >>> buffer_key(torch.zeros(2, dtype=torch.bfloat16))
        BufferKey(device='cpu', dtype='torch.bfloat16')
    """
    return BufferKey(str(t.device), str(t.dtype))


@dataclass(frozen=True, slots=True, eq=False)
class ParamTable:
    """Every parameter in global index order (a state dict's), its buffer key (``keys``), and
    per group its ``spans`` ``(first index, number of parameters)``.

    Example:
        >>> a, b, c = torch.zeros(3), torch.zeros(2), torch.zeros(4)
        >>> table = ParamTable.of([{"params": [a, b]}, {"params": [c]}])
        >>> table.index(c), table.group_of(2), table.spans
        (2, 1, ((0, 2), (2, 1)))
    """

    params: tuple[Tensor, ...]
    spans: tuple[tuple[int, int], ...]
    _index: dict[Tensor, int] = field(init=False, repr=False)
    _group_of: tuple[int, ...] = field(init=False, repr=False)
    keys: tuple[BufferKey, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        starts = prefix_sums([n for _, n in self.spans])
        if [a for a, _ in self.spans] + [len(self.params)] != starts:
            raise ValueError(
                f"group spans {self.spans} do not tile {len(self.params)} parameters: build "
                "the table with ParamTable.of(param_groups)"
            )
        index: dict[Tensor, int] = {}
        for k, p in enumerate(self.params):
            if p in index:
                raise ValueError(
                    f"parameter {k} is parameter {index[p]} again: a parameter may appear once "
                    "in an optimizer's groups"
                )
            index[p] = k
        object.__setattr__(self, "_index", index)
        object.__setattr__(
            self, "_group_of", tuple(g for g, (_, n) in enumerate(self.spans) for _ in range(n))
        )
        object.__setattr__(self, "keys", tuple(buffer_key(p) for p in self.params))

    @classmethod
    def of(cls, param_groups: Sequence[Mapping[str, Any]]) -> ParamTable:
        """The table of ``param_groups`` (dicts with a ``"params"`` list, as torch's)."""
        sizes = [len(g["params"]) for g in param_groups]
        params = tuple(p for g in param_groups for p in g["params"])
        return cls(params, tuple(zip(prefix_sums(sizes), sizes)))

    def __len__(self) -> int:
        return len(self.params)

    def __contains__(self, p: object) -> bool:
        return isinstance(p, Tensor) and p in self._index

    def index(self, p: Tensor) -> int:
        """The global index of parameter ``p`` (a KeyError if it is none of these)."""
        return self._index[p]

    def group_of(self, k: int) -> int:
        """The group of the parameter of global index ``k``."""
        return self._group_of[k]

    def names(self, model: nn.Module | None, *, strict: bool = True) -> list[str]:
        """Each parameter's name in ``model`` (the module a DDP wraps; a tied weight by its first
        name); its index without a model or, unless ``strict``, outside it.

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> ParamTable.of([{"params": [model.bias, model.weight]}]).names(model)
            ['bias', 'weight']
        """
        if model is None:
            return [str(k) for k in range(len(self.params))]
        named = module_of(model).named_parameters()
        name_of: dict[Tensor, str] = {p: name for name, p in named}  # tied: its first name
        missing = [k for k, p in enumerate(self.params) if p not in name_of]
        if missing and strict:
            raise ValueError(
                f"the optimizer's parameters {first_of(missing)} (of {len(self.params)}) are not "
                "parameters of the model: pass the model the optimizer was built from"
            )
        return [name_of.get(p, str(k)) for k, p in enumerate(self.params)]

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(p.numel() for p in self.params)

    def group_numels(self) -> list[list[int]]:
        """Per group, its parameters' numbers of elements (what ``sorted_greedy_groups`` takes)."""
        return [[p.numel() for p in self.params[a : a + n]] for a, n in self.spans]


def module_of(model: nn.Module) -> nn.Module:
    """The module a ``DistributedDataParallel`` wraps, else ``model`` itself.

    Example:
        >>> module_of(torch.nn.Linear(2, 1))
        Linear(in_features=2, out_features=1, bias=True)
    """
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model
