"""LocalShard, one rank's share, without a process group: every rank simulated in one process."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch
from torch import Tensor

from zero_functional.core.consolidation import (
    PARTIAL_KEY,
    Consolidation,
    merge_shards,
    rank_state_dict,
)
from zero_functional.core.grad_norm import local_norm, total_norm
from zero_functional.core.ownership import Ownership, flat_ownership, sorted_greedy_ownership
from zero_functional.core.param_table import ParamTable
from zero_functional.core.plans import plan_moves
from zero_functional.functional import functional_spec
from zero_functional.shell.local_shard import LocalShard
from zero_functional.shell.steppers import FunctionalStepper, choose_stepper, state_schemas

WORLD = 3
SHAPES = [(5, 3), (7,), (2, 2), (1,)]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _ownerships() -> list[Ownership]:
    numels = [torch.Size(s).numel() for s in SHAPES]
    return [sorted_greedy_ownership([numels], WORLD), flat_ownership(numels, WORLD)]


def _shards(
    params: list[torch.nn.Parameter], ownership: Ownership, cls: type[torch.optim.Optimizer]
) -> list[LocalShard]:
    """One shard per simulated rank, each with its own state, over the same parameters."""
    probe = cls([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    shards = []
    for rank in range(WORLD):
        groups: list[dict[str, Any]] = [{**probe.defaults, "params": list(params)}]
        owned = {s.param for s in ownership.owned(rank)}
        state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        stepper = choose_stepper(
            functional_spec(cls), False, probe, False, groups, owned, state, {}
        )
        shards.append(
            LocalShard(ownership, rank, ParamTable.of(groups), groups, state, stepper, cls.__name__)
        )
    return shards


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.RMSprop])
@pytest.mark.parametrize("which", [0, 1], ids=["sorted_greedy", "flat"])
def test_every_rank_updating_its_pieces_equals_torch_optim_on_the_whole(
    cls: type[torch.optim.Optimizer], which: int
) -> None:
    ours, ref = _params(), _params()
    shards = _shards(ours, _ownerships()[which], cls)
    torch_opt = cls(ref, lr=0.1)
    for step in range(3):
        _grads(ours, step)
        _grads(ref, step)
        for shard in shards:
            shard.update(shard.grads())
        torch_opt.step()
    # the same gradients, other kernels (pieces against whole tensors): at most one ulp
    # (2^-23 relative) per step where an update's last bits cross a boundary, 3 steps: 3.6e-7
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("which", [0, 1], ids=["sorted_greedy", "flat"])
def test_cut_install_and_merge_give_back_the_whole_state(which: int) -> None:
    params = _params()
    plain = torch.optim.Adam(params, lr=0.1)
    _grads(params, 0)
    plain.step()
    whole = plain.state_dict()["state"]
    shards = _shards(params, _ownerships()[which], torch.optim.Adam)
    groups = plain.state_dict()["param_groups"]
    for shard in shards:
        shard.install(shard.cut(whole), groups, copy=True)
    merged = merge_shards([s.cpu_shard() for s in shards], SHAPES)
    assert sorted(merged) == sorted(whole)
    for k, state in whole.items():
        for key, value in state.items():
            torch.testing.assert_close(merged[k][key], value, rtol=0, atol=0)


def test_outgoing_and_incoming_move_every_element_to_its_new_owner() -> None:
    params = _params()
    old, new = _ownerships()
    shards = _shards(params, old, torch.optim.SGD)
    for shard in shards:
        for g in shard.param_groups:
            g["momentum"] = 0.9
    _grads(params, 0)
    for shard in shards:
        shard.update(shard.grads())
    before = merge_shards([s.cpu_shard() for s in shards], SHAPES)
    plans = [plan_moves(old, new, r) for r in range(WORLD)]
    sent = [s.outgoing(plan, old) for s, plan in zip(shards, plans)]
    for rank, (shard, plan) in enumerate(zip(shards, plans)):
        arrived = {t: part for parts in sent for t, part in parts.get(rank, {}).items()}
        shard.incoming(plan, new, arrived)
    after = [
        LocalShard(new, r, s.table, s.param_groups, s.state, s.stepper, s.name)
        for r, s in enumerate(shards)
    ]
    merged = merge_shards([s.cpu_shard() for s in after], SHAPES)
    for k, state in before.items():
        torch.testing.assert_close(merged[k]["momentum_buffer"], state["momentum_buffer"])


def test_piece_names_what_was_given_for_a_parameter_this_rank_does_not_own() -> None:
    shard = _shards(_params(), _ownerships()[0], torch.optim.SGD)[0]
    foreign = next(k for k in range(len(SHAPES)) if k not in shard.pieces)
    with pytest.raises(ValueError, match=f"gradients for parameter {foreign}, of which rank 0"):
        shard.update({foreign: torch.zeros(1)})


def test_check_trainable_follows_freezing_and_names_an_unfrozen_parameter_under_ddp() -> None:
    params = _params()
    shard = _shards(params, _ownerships()[1], torch.optim.SGD)[0]
    assert not shard.check_trainable(ddp=True)
    params[1].requires_grad_(False)
    assert shard.check_trainable(ddp=True) and not shard.check_trainable(ddp=True)
    frozen = LocalShard(
        shard.ownership, 0, shard.table, shard.param_groups, shard.state, shard.stepper, "SGD"
    )
    params[1].requires_grad_(True)
    with pytest.raises(RuntimeError, match="7"):
        frozen.check_trainable(ddp=True)
    # no DDP known: it trains once its gradient is found averaged (asked until then)
    assert frozen.check_trainable(ddp=False) and frozen.trainable[1]
    assert frozen.unchecked_grads() == {} and frozen.check_trainable(ddp=False)
    params[1].grad = torch.ones_like(params[1])
    assert list(frozen.unchecked_grads()) == [1]
    frozen.averaged([1])
    assert frozen.unchecked_grads() == {} and not frozen.check_trainable(ddp=False)


def test_a_real_stepper_over_whole_parameters_refuses_pieces_and_steps_with_its_closure() -> None:
    params = _params()
    ownership = _ownerships()[0]
    probe = torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    groups: list[dict[str, Any]] = [{**probe.defaults, "params": list(params)}]
    state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
    owned = {s.param for s in ownership.owned(0)}
    stepper = choose_stepper(None, False, probe, True, groups, owned, state, {})
    shard = LocalShard(ownership, 0, ParamTable.of(groups), groups, state, stepper, "LBFGS")
    with pytest.raises(RuntimeError, match="update_owned needs an optimizer that runs on pieces"):
        shard.pieces_stepper()
    loss, grads = shard.local_step(lambda: 1.5)
    assert (loss, grads) == (1.5, None)


def test_local_step_runs_the_closure_with_grad_and_returns_the_owned_gradients() -> None:
    params = _params()
    shard = _shards(params, _ownerships()[1], torch.optim.SGD)[1]
    _grads(params, 0)

    def closure() -> float:
        assert torch.is_grad_enabled()
        return 2.0

    with torch.no_grad():
        loss, grads = shard.local_step(closure)
    assert loss == 2.0 and grads is not None and sorted(grads) == sorted(shard.pieces)


def test_the_ranks_local_norms_total_torchs_clip_grad_norm() -> None:
    for which, norm_type in [(0, 2.0), (1, 2.0), (1, 1.0), (1, float("inf"))]:
        params = _params()
        _grads(params, 0)
        grads = [p.grad for p in params if p.grad is not None]
        shards = _shards(params, _ownerships()[which], torch.optim.SGD)
        device = torch.device("cpu")
        norms = [local_norm(grads, list(s.grads().values()), norm_type, device) for s in shards]
        ours = total_norm(torch.stack(norms), norm_type)
        theirs = torch.nn.utils.get_total_norm(grads, norm_type)
        torch.testing.assert_close(ours, theirs)
    with pytest.raises(ValueError, match="norm_type must be positive"):
        local_norm(grads, grads, 0.0, device)
    with pytest.raises(RuntimeError, match="non-finite"):
        total_norm(torch.tensor([1.0, float("nan")]), 2.0, error_if_nonfinite=True)


def test_rank_state_dict_is_empty_before_any_change_partial_off_the_target_and_refused_when_stale() -> (
    None
):
    groups = [{"params": [torch.zeros(2), torch.zeros(3)], "lr": 0.1}, {"params": [torch.zeros(1)]}]
    fresh = rank_state_dict(groups, [], updates=0, consolidated_at=None, rank=1)
    assert fresh == {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"params": [2]}]}
    partial = rank_state_dict(groups, [], updates=2, consolidated_at=2, rank=1)
    assert partial[PARTIAL_KEY] is True and partial["state"] == {}
    with pytest.raises(RuntimeError, match=r"consolidate_state_dict\(to=1\)"):
        rank_state_dict(groups, [], updates=3, consolidated_at=2, rank=1)


def test_state_schemas_are_the_keys_one_step_makes_for_elementwise_classes_only() -> None:
    schemas = state_schemas(torch.optim.Adam, [{"lr": 0.1}, {"lr": 0.1, "amsgrad": True}], {})
    assert schemas[0] == {"step": "scalar", "exp_avg": "elementwise", "exp_avg_sq": "elementwise"}
    assert schemas[1] is not None and schemas[1]["max_exp_avg_sq"] == "elementwise"
    assert state_schemas(torch.optim.LBFGS, [{"lr": 1.0}], {}) == [None]


def test_functional_stepper_puts_step_in_float32_on_the_parameters_device() -> None:
    params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    ownership = flat_ownership([4], 1)
    groups: list[dict[str, Any]] = [{"params": params, "lr": 0.1}]
    state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
    stepper = FunctionalStepper(functional_spec(torch.optim.Adam), compile=False)  # type: ignore[arg-type]
    shard = LocalShard(ownership, 0, ParamTable.of(groups), groups, state, stepper, "Adam")
    loaded = {0: {"step": torch.tensor(3), "exp_avg": torch.ones(4), "exp_avg_sq": torch.ones(4)}}
    shard.install(loaded, [{"lr": 0.2, "params": [0]}], copy=True)
    assert state[params[0]]["step"].dtype == torch.float32
    assert state[params[0]]["exp_avg"].dtype == torch.float64
    assert groups[0]["lr"] == 0.2


def test_low_precision_pieces_step_through_float32_main_copies_kept_in_their_state() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6).to(torch.bfloat16))]
    ref = params[0].detach().float().clone()
    groups: list[dict[str, Any]] = [{"params": params, "lr": 1e-3, "momentum": 0.0}]
    state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
    stepper = FunctionalStepper(functional_spec(torch.optim.SGD), compile=False)  # type: ignore[arg-type]
    shard = LocalShard(
        flat_ownership([6], 2),
        1,
        ParamTable.of(groups),
        groups,
        state,
        stepper,
        "SGD",
        torch.float32,
    )
    assert shard.main_params()[params[0]].dtype == torch.float32  # before any step: upcast
    grad = torch.ones(3, dtype=torch.bfloat16)
    for _ in range(3):
        shard.update({0: grad})
    main = shard.main_params()[params[0]]
    torch.testing.assert_close(main, ref[3:] - 3e-3)
    assert torch.equal(params[0].detach()[3:], main.to(torch.bfloat16))
    assert torch.equal(params[0].detach()[:3], ref[:3].to(torch.bfloat16))  # rank 0's, untouched


def test_a_consolidation_is_stale_once_the_state_changes_again() -> None:
    groups = [{"params": [torch.zeros(2)], "lr": 0.1}]
    book = Consolidation()
    assert book.state_dict(groups, rank=0)["state"] == {}
    book.changed()
    with pytest.raises(RuntimeError, match="not been consolidated"):
        book.state_dict(groups, rank=0)
    book.gathered([])  # consolidated onto another rank
    assert book.state_dict(groups, rank=0)[PARTIAL_KEY] is True
    book.gathered([{0: ((0, 2), {"momentum_buffer": torch.ones(2)})}])
    assert list(book.state_dict(groups, rank=0)["state"]) == [0]
    book.changed()
    with pytest.raises(RuntimeError, match="not been consolidated"):
        book.state_dict(groups, rank=0)
