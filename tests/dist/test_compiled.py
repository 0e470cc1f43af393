"""The compiled updates against the eager foreach path; recompilation; the fallback to eager.

Compiling takes seconds, so each configuration runs once (module-scoped fixtures) and several
tests read the result. The per-step hyperparameters change at every step, as a scheduler
changes them, to show that new values reuse the compiled graph.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor
from torch._dynamo.utils import counters

import zero_functional.functional.compiled as compiled
from zero_functional.functional import (
    AdamState,
    SGDState,
    adam_init,
    adam_update_,
    sgd_init,
    sgd_update_,
)

from tests.helpers import run_ranks

compiled_adam_update_ = functools.partial(adam_update_, compile=True)


compiled_sgd_update_ = functools.partial(sgd_update_, compile=True)


STEPS = 4


# a transposed view, an empty tensor and a length with a vector tail (1000 = 62 * 16 + 8)
SHAPES = [(3, 5), (1000,), (0,), (7,), "transposed"]


# torch's CPU kernels round a * b + c once (fmadd) only with a vectorized capability; the
# graph always rounds once, so the bitwise claims hold there
FMA_KERNELS = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _tensors(dtype: torch.dtype, gen: torch.Generator) -> list[Tensor]:
    out = []
    for s in SHAPES:
        if s == "transposed":
            out.append(torch.randn(6, 4, generator=gen, dtype=dtype).t())
        else:
            out.append(torch.randn(s, generator=gen, dtype=dtype))
    return out


def _unique_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


@dataclass
class Run:
    """One configuration through eager foreach and through the compiled update."""

    eager_params: list[Tensor]
    eager_state: AdamState | SGDState
    params: list[Tensor]
    state: AdamState | SGDState
    graphs_added_after_warmup: int
    grads_untouched: bool


def _run(
    eager: Callable[..., None],
    ours: Callable[..., None],
    init: Callable[[list[Tensor]], AdamState | SGDState],
    dtype: torch.dtype,
    schedule: Callable[[int], dict[str, object]],
    warmup: int,
) -> Run:
    gen = torch.Generator().manual_seed(0)
    start = _tensors(dtype, gen)
    eager_params = [p.clone() for p in start]
    params = [p.clone() for p in start]
    eager_state, state = init(eager_params), init(params)
    untouched = True
    graphs = 0
    for k in range(STEPS):
        grads = _tensors(dtype, gen)
        copies = [g.clone() for g in grads]
        eager(eager_params, grads, eager_state, **schedule(k))
        ours(params, grads, state, **schedule(k))
        untouched &= all(torch.equal(g, c) for g, c in zip(grads, copies))
        if k + 1 == warmup:
            graphs = _unique_graphs()
    return Run(eager_params, eager_state, params, state, _unique_graphs() - graphs, untouched)


ADAM_CASES: dict[str, tuple[torch.dtype, dict[str, object]]] = {
    "adam": (torch.float32, {}),
    "adam amsgrad maximize L2": (
        torch.float32,
        {"amsgrad": True, "maximize": True, "weight_decay": 0.1},
    ),
    "adamw beta1=0.3": (torch.float32, {"decoupled_weight_decay": True, "weight_decay": 0.1}),
    "adamw amsgrad float64": (
        torch.float64,
        {"amsgrad": True, "decoupled_weight_decay": True, "weight_decay": 0.1},
    ),
}


def _adam_schedule(case: str, flags: dict[str, object]) -> Callable[[int], dict[str, object]]:
    beta1 = 0.3 if "beta1=0.3" in case else 0.9  # 0.3: torch's other lerp formula (weight >= 0.5)

    def schedule(k: int) -> dict[str, object]:
        hyper = dict(flags)
        hyper.update(lr=0.01 * (k + 1), betas=(beta1 - 0.01 * k, 0.999 - 0.001 * k))
        hyper.update(eps=1e-8 * (k + 1))
        if flags.get("weight_decay"):
            hyper["weight_decay"] = 0.1 / (k + 1)
        return hyper

    return schedule


@pytest.fixture(scope="module")
def adam_runs() -> dict[str, Run]:
    runs = {}
    for case, (dtype, flags) in ADAM_CASES.items():
        amsgrad = bool(flags.get("amsgrad"))
        runs[case] = _run(
            lambda *a, **kw: adam_update_(*a, **kw, fused=False),
            compiled_adam_update_,
            lambda ps, amsgrad=amsgrad: adam_init(ps, amsgrad=amsgrad),
            dtype,
            _adam_schedule(case, flags),
            warmup=1,
        )
    return runs


SGD_CASES: dict[str, tuple[torch.dtype, dict[str, object]]] = {
    "nesterov L2": (torch.float32, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
    "dampening maximize": (torch.float32, {"momentum": 0.9, "dampening": 0.3, "maximize": True}),
    "no momentum": (torch.float32, {}),
    "momentum L2 float64": (torch.float64, {"momentum": 0.9, "weight_decay": 0.1}),
}


def _sgd_schedule(flags: dict[str, object]) -> Callable[[int], dict[str, object]]:
    def schedule(k: int) -> dict[str, object]:
        hyper = dict(flags, lr=0.05 / (k + 1))
        if flags.get("momentum"):
            hyper["momentum"] = 0.9 - 0.05 * k
        if flags.get("dampening"):
            hyper["dampening"] = 0.3 + 0.1 * k
        if flags.get("weight_decay"):
            hyper["weight_decay"] = 0.1 * (k + 1)
        return hyper

    return schedule


@pytest.fixture(scope="module")
def sgd_runs() -> dict[str, Run]:
    return {
        # the first step makes the momentum buffers (its own graph): warm up for two steps
        case: _run(sgd_update_, compiled_sgd_update_, sgd_init, dtype, _sgd_schedule(flags), 2)
        for case, (dtype, flags) in SGD_CASES.items()
    }


def _tensor_lists(state: AdamState | SGDState) -> dict[str, list[Tensor]]:
    return {name: [t for t in getattr(state, name) if t is not None] for name in state._fields}


def _assert_close(run: Run, tol: float) -> None:
    # The same gradients, nothing fed back, STEPS = 4: inductor's code (-ffp-contract=off) may
    # round an update in another order, a few ulps of the update, which move a value one ulp of
    # itself (2^-23 relative) where they cross a rounding boundary: 4 x 2^-23 |b| < tol (1 + |b|).
    for p, q in zip(run.eager_params, run.params):
        torch.testing.assert_close(q, p, rtol=tol, atol=tol)
    eager, ours = _tensor_lists(run.eager_state), _tensor_lists(run.state)
    for name in eager:
        assert len(ours[name]) == len(eager[name]), name
        for a, b in zip(eager[name], ours[name]):
            torch.testing.assert_close(b, a, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", ADAM_CASES)
def test_compiled_adam_matches_eager_foreach_within_1e6(
    adam_runs: dict[str, Run], case: str
) -> None:
    _assert_close(adam_runs[case], 1e-6)


@pytest.mark.parametrize("case", SGD_CASES)
def test_compiled_sgd_matches_eager_foreach_within_1e6(sgd_runs: dict[str, Run], case: str) -> None:
    _assert_close(sgd_runs[case], 1e-6)


def test_adam_step_counts_are_bitwise_equal(adam_runs: dict[str, Run]) -> None:
    for run in adam_runs.values():
        assert isinstance(run.state, AdamState) and isinstance(run.eager_state, AdamState)
        for a, b in zip(run.eager_state.step, run.state.step):
            assert torch.equal(a, b) and b.item() == STEPS


@pytest.mark.skipif(not FMA_KERNELS, reason="torch's CPU kernels here do not round with FMA")
def test_float32_adam_moments_are_bitwise_equal_unless_l2_decay_reads_the_params(
    adam_runs: dict[str, Run],
) -> None:
    # Params are not: torch's CPU sqrt (MKL) is off by an ulp where the graph's is exact, and
    # L2 decay carries that difference into the gradient and so into the moments.
    for case in ("adam", "adamw beta1=0.3"):
        eager, ours = (
            _tensor_lists(adam_runs[case].eager_state),
            _tensor_lists(adam_runs[case].state),
        )
        for name in ("exp_avg", "exp_avg_sq"):
            assert all(torch.equal(a, b) for a, b in zip(eager[name], ours[name])), (case, name)


@pytest.mark.skipif(not FMA_KERNELS, reason="torch's CPU kernels here do not round with FMA")
def test_float32_sgd_params_and_buffers_are_bitwise_equal(sgd_runs: dict[str, Run]) -> None:
    for case in ("nesterov L2", "dampening maximize", "no momentum"):
        run = sgd_runs[case]
        assert all(torch.equal(a, b) for a, b in zip(run.eager_params, run.params)), case
        eager, ours = _tensor_lists(run.eager_state), _tensor_lists(run.state)
        assert all(
            torch.equal(a, b) for a, b in zip(eager["momentum_buffer"], ours["momentum_buffer"])
        )


def test_first_momentum_buffers_are_new_tensors_laid_out_like_the_grads(
    sgd_runs: dict[str, Run],
) -> None:
    run = sgd_runs["nesterov L2"]
    assert isinstance(run.state, SGDState) and isinstance(run.eager_state, SGDState)
    for a, b in zip(run.eager_state.momentum_buffer, run.state.momentum_buffer):
        assert a is not None and b is not None and a.stride() == b.stride()


def test_new_hyperparameter_values_do_not_recompile(
    adam_runs: dict[str, Run], sgd_runs: dict[str, Run]
) -> None:
    # every step after the warm-up had new lr, betas, eps, weight_decay, momentum, dampening
    for case, run in {**adam_runs, **sgd_runs}.items():
        assert run.graphs_added_after_warmup == 0, case


def test_grads_are_never_modified(adam_runs: dict[str, Run], sgd_runs: dict[str, Run]) -> None:
    for case, run in {**adam_runs, **sgd_runs}.items():
        assert run.grads_untouched, case


def test_sgd_group_with_and_without_buffers_matches_eager() -> None:
    # a param that had no grad at the first step has no buffer yet while the others do
    gen = torch.Generator().manual_seed(1)
    start = [torch.randn(9, generator=gen) for _ in range(3)]
    grads = [torch.randn(9, generator=gen) for _ in range(3)]
    copies = [g.clone() for g in grads]
    hyper: dict[str, object] = {"lr": 0.1, "momentum": 0.9, "nesterov": True}
    eager, ours = [p.clone() for p in start], [p.clone() for p in start]
    eager_state = SGDState([grads[0].clone(), None, grads[2].clone()])
    state = SGDState([grads[0].clone(), None, grads[2].clone()])
    sgd_update_(eager, grads, eager_state, **hyper)
    compiled_sgd_update_(ours, grads, state, **hyper)
    for a, b in zip(eager + eager_state.momentum_buffer, ours + state.momentum_buffer):
        assert a is not None and b is not None
        # one step on the same values: an ulp of |a| < 4 at most, 4.8e-7
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    # the new buffer is a copy of the grad, which stays as it was
    born = state.momentum_buffer[1]
    assert born is not None and born.data_ptr() != grads[1].data_ptr()
    assert all(torch.equal(g, c) for g, c in zip(grads, copies))


def test_failed_compilation_warns_once_and_runs_eager(
    fresh_caches: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    attempts = []

    def failing(fn: Callable[..., list[Tensor]]) -> Callable[..., list[Tensor]]:
        def run(*args: object, **kwargs: object) -> list[Tensor]:
            attempts.append(fn.__name__)
            raise RuntimeError("dynamo says no\nsecond line")

        return run

    monkeypatch.setattr(compiled, "_compile", failing)
    gen = torch.Generator().manual_seed(2)
    start = [torch.randn(5, generator=gen), torch.randn(2, 2, generator=gen)]
    eager, ours = [p.clone() for p in start], [p.clone() for p in start]
    eager_state, state = adam_init(eager), adam_init(ours)
    sgd_eager, sgd_ours = [p.clone() for p in start], [p.clone() for p in start]
    sgd_eager_state, sgd_state = sgd_init(sgd_eager), sgd_init(sgd_ours)
    with caplog.at_level(logging.WARNING, logger=compiled.__name__):
        for k in range(3):
            grads = [torch.randn(p.shape, generator=gen) for p in start]
            adam_update_(eager, grads, eager_state, lr=0.1 * (k + 1), fused=False)
            compiled_adam_update_(ours, grads, state, lr=0.1 * (k + 1), fused=False)
            sgd_update_(sgd_eager, grads, sgd_eager_state, lr=0.1, maximize=True)
            compiled_sgd_update_(sgd_ours, grads, sgd_state, lr=0.1, maximize=True)
    assert attempts == ["_adam_graph", "_sgd_graph"]  # each configuration tried once
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert all("RuntimeError: dynamo says no" in w and "float32 on cpu" in w for w in warnings)
    assert "second line" not in warnings[0]
    for a, b in zip(eager + sgd_eager, ours + sgd_ours):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(eager_state.exp_avg_sq, state.exp_avg_sq))
    assert [s.item() for s in state.step] == [3.0, 3.0]  # the step counted once per update


def _missing_cxx_worker(rank: int, world_size: int, cache_dir: str) -> tuple[bool, list[str]]:
    """In a fresh process (no kernel compiled before, no logging changed by an earlier test):
    the update with no working C++ compiler against the eager one, and what it warned."""
    import os

    import torch._inductor.config as inductor_config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # no kernel of an earlier run on disk
    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(compiled.__name__).addHandler(handler)
    params, expected = [torch.ones(11)], [torch.ones(11)]
    state = sgd_init(params)
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        compiled_sgd_update_(params, [torch.ones(11)], state, lr=0.5)
    sgd_update_(expected, [torch.ones(11)], sgd_init(expected), lr=0.5)
    return torch.equal(params[0], expected[0]), warned


def test_missing_cxx_compiler_falls_back_with_a_warning_naming_it(tmp_path: Path) -> None:
    [(equal, warned)] = run_ranks(_missing_cxx_worker, 1, str(tmp_path), timeout_s=120)
    assert equal
    [warning] = warned
    assert "C++ compiler" in warning and "/nonexistent/c++" in warning


def test_unsupported_dtype_warns_once_and_runs_eager(
    fresh_caches: None, caplog: pytest.LogCaptureFixture
) -> None:
    start = [torch.randn(4).to(torch.bfloat16)]
    ours, eager = [p.clone() for p in start], [p.clone() for p in start]
    state, eager_state = adam_init(ours), adam_init(eager)
    with caplog.at_level(logging.WARNING, logger=compiled.__name__):
        for _ in range(2):
            compiled_adam_update_(ours, [torch.ones(4, dtype=torch.bfloat16)], state, lr=0.1)
            adam_update_(eager, [torch.ones(4, dtype=torch.bfloat16)], eager_state, lr=0.1)
    assert torch.equal(ours[0], eager[0])
    [warning] = [r.getMessage() for r in caplog.records]
    assert "not bfloat16 on cpu" in warning


def test_nothing_compiles_for_empty_lists_zero_elements_or_fused_true(
    compiles: list[str],
) -> None:
    compiled_adam_update_([], [], adam_init([]))
    compiled_sgd_update_([], [], sgd_init([]), momentum=0.9)
    empty = [torch.zeros(0), torch.zeros(2, 0)]
    state = adam_init(empty)
    compiled_adam_update_(empty, [torch.zeros(0), torch.zeros(2, 0)], state)
    assert [s.item() for s in state.step] == [1.0, 1.0]
    params, expected = [torch.ones(3)], [torch.ones(3)]
    compiled_adam_update_(params, [torch.ones(3)], adam_init(params), lr=0.1, fused=True)
    adam_update_(expected, [torch.ones(3)], adam_init(expected), lr=0.1, fused=True)
    assert torch.equal(params[0], expected[0])
    assert compiles == []


def test_errors_are_the_eager_ones() -> None:
    with pytest.raises(ValueError, match="2 params but 1 grads"):
        compiled_adam_update_([torch.ones(1), torch.ones(1)], [torch.ones(1)], adam_init([]))
    with pytest.raises(TypeError, match="lr is a Tensor"):
        p = [torch.ones(1)]
        compiled_sgd_update_(p, [torch.ones(1)], sgd_init(p), lr=torch.tensor(0.1))


def _shell_worker(rank: int, world_size: int) -> float:
    """The shell's compile=True equals its eager default within 1e-6 over a few steps."""
    from torch import nn

    from zero_functional.optimizer import ZeroRedundancyOptimizer

    results = []
    for compile_ in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, partition="flat", compile=compile_, lr=0.01
        )
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            opt.zero_grad()
            model(torch.randn(4, 8, generator=g)).square().mean().backward()
            opt.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return (results[0] - results[1]).abs().max().item()


def test_the_shell_runs_the_compiled_update_when_asked() -> None:

    for diff in run_ranks(_shell_worker, 2, timeout_s=240):
        # Compiled and eager AdamW on the same gradients: inductor's code (-ffp-contract=off) may
        # round an update's operations in another order, a few ulps of the update (<= lr = 0.01) per
        # step, one ulp of a parameter (<= 6e-8 below 1) where that crosses a boundary: 3 x 6e-8.
        assert diff < 1e-6
