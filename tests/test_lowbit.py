"""torchao's low-bit AdamW (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``) as ``optimizer_class``
(issue 31): block-aligned ``"flat"`` cuts, the quantized-or-not decision taken on the whole
parameter, the state bytes per rank, and parity with the plain torchao optimizer in every mode.

The steps run eagerly (``torch.compiler.set_stance("force_eager")``): torchao compiles one graph
per tensor shape, ~5-15 s each on CPU, and a piece has other shapes than its parameter. Eager,
every comparison here is bitwise.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from zero_functional import ZeroRedundancyOptimizer, checkpoint
from zero_functional.checkpoint import storage
from zero_functional.comm.testing import fake_world
from zero_functional.core.layout import piece_view
from zero_functional.core.piece_state import slice_state
from zero_functional.functional.lowbit import LOW_BIT
from zero_functional.functional.registry import update_block, update_kind
from zero_functional.hooks import (
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    reduce_scatter_hook,
)

from tests.helpers import reduced_grads, run_ranks

ao = pytest.importorskip("torchao.optim")

CLASSES = {"8bit": ao.AdamW8bit, "4bit": ao.AdamW4bit, "fp8": ao.AdamWFp8}
PER_ELEMENT = {"8bit": 2 * (1 + 4 / 256), "4bit": 2 * (0.5 + 4 / 128), "fp8": 2 * (1 + 4 / 256)}
"""Both moments' bytes per element: codes plus one fp32 scale per block."""
SHAPES = [(64, 96), (96,), (48, 96), (4100,)]
"""Quantized (6144, 4608 elements), fp32 (96: small; 4100: not whole blocks)."""


def eager() -> None:
    """torchao's steps without torch.compile (its graphs take seconds per shape on CPU)."""
    torch.compiler.set_stance("force_eager")


def tensors(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*s, generator=g).to(dtype)) for s in SHAPES]


def grads_of(step: int, params: list[nn.Parameter]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


def dequantized(t: torch.Tensor) -> torch.Tensor:
    return (t.dequantize() if hasattr(t, "dequantize") else t).reshape(-1)


def state_bytes(state: dict[str, Any]) -> int:
    """The per-element state's bytes: a quantized tensor's codes and scales (its 1 KiB code
    table is a constant per tensor), a plain tensor's elements; the 0-d step is not counted."""
    total = 0
    for v in state.values():
        if hasattr(v, "codes"):
            total += v.codes.nbytes + v.scale.nbytes
        elif v.dim():
            total += v.nbytes
    return total


def test_torchao_classes_are_elementwise_per_block_of_their_size() -> None:
    assert [update_kind(c) for c in CLASSES.values()] == ["elementwise"] * 3
    assert [update_block(c) for c in CLASSES.values()] == [256, 128, 256]
    assert update_block(ao.AdamW8bit, {"block_size": 512}) == 512


@pytest.mark.parametrize("name", list(CLASSES))
def test_flat_pieces_cut_on_blocks_and_equal_plain_torchao_bitwise(name: str) -> None:
    """At 2-4 ranks (torch's fake group: one process is each rank in turn) every owned piece,
    parameter and state, equals the plain optimizer's on the whole parameters, bitwise; the
    state is quantized exactly where the plain optimizer's is, small pieces included."""
    eager()
    cls, block = CLASSES[name], update_block(CLASSES[name])
    ref = tensors()
    plain = cls(ref, lr=1e-2)
    for t in range(3):
        for p, g in zip(ref, grads_of(t, ref)):
            p.grad = g
        plain.step()
    for world in (2, 3, 4):
        for rank in range(world):
            with fake_world(world, rank):
                ps = tensors()
                zero = ZeroRedundancyOptimizer(ps, cls, partition="flat", lr=1e-2)
                for t in range(3):
                    for p, g in zip(ps, grads_of(t, ps)):
                        p.grad = g
                    zero.step()
                for piece in zero.ownership.owned(rank):
                    k, n = piece.param, ps[piece.param].numel()
                    assert piece.start % block == 0 and (piece.stop % block == 0 or piece.stop == n)
                    assert torch.equal(piece_view(ps[k], piece), piece_view(ref[k], piece))
                    mine, want = zero.state[ps[k]], plain.state[ref[k]]
                    for key in ("exp_avg", "exp_avg_sq"):
                        assert type(mine[key]) is type(want[key]), (world, rank, piece, key)
                        assert torch.equal(
                            dequantized(mine[key]),
                            dequantized(want[key])[piece.start : piece.stop],
                        )


@pytest.mark.parametrize("name", list(CLASSES))
def test_flat_state_bytes_per_rank_are_the_low_bit_bytes_over_n(name: str) -> None:
    """Two 256 x 256 weights under ``"flat"`` at 2-4 ranks: each rank's state is
    ``PER_ELEMENT * numel / N`` bytes within 1% (one step, eager)."""
    eager()
    cls = CLASSES[name]
    numel = 2 * 256 * 256
    for world in (2, 3, 4):
        for rank in range(world):
            with fake_world(world, rank):
                ps = [nn.Parameter(torch.randn(256, 256)) for _ in range(2)]
                zero = ZeroRedundancyOptimizer(ps, cls, partition="flat")
                for p in ps:
                    p.grad = torch.randn_like(p)
                zero.step()
                got = sum(state_bytes(zero.state[p]) for p in ps if zero.state.get(p))
                want = PER_ELEMENT[name] * numel / world
                assert abs(got / want - 1) < 0.01, (world, rank, got, want)


# ------------------------------------------------------------------ every mode, real ranks

HOOKS: dict[str, Callable[..., Any]] = {
    "hook": hook_with_zero_step,
    "interleaved": hook_with_zero_step_interleaved,
}


def model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 48), nn.Linear(48, 4)).to(
        dtype
    )


def backward(module: nn.Module, rank: int, world: int, step: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(4 * world, 64, generator=g), torch.randn(4 * world, 4, generator=g)
    mine = slice(4 * rank, 4 * (rank + 1))
    ((module(x[mine].to(dtype)) - y[mine].to(dtype)) ** 2).mean().backward()


def run_mode(rank: int, world: int, name: str, mode: str, partition: str) -> float:
    """Three steps of ``CLASSES[name]`` in ``mode`` against the plain optimizer stepped on the
    very gradients reduced (on fp32 copies of bf16 parameters with ``main_params``): the
    largest difference of parameters (main copies), 0.0 when bitwise."""
    cls = CLASSES[name]
    main = mode == "main_params"
    dtype = torch.bfloat16 if main else torch.float32
    module = model(dtype)
    ref = [nn.Parameter(p.detach().float().clone()) for p in module.parameters()]
    plain = cls(ref, lr=1e-2)
    overlap = mode in HOOKS
    ddp = DDP(module, bucket_cap_mb=0.01) if mode in (*HOOKS, "reduce_scatter_hook") else None
    zero = ZeroRedundancyOptimizer(
        list(module.parameters()),
        cls,
        partition=partition,
        overlap_with_ddp=overlap,
        parameters_as_bucket_view=mode == "bucket_view",
        main_params_dtype=torch.float32 if main else None,
        lr=1e-2,
    )
    if ddp is not None:
        hook = HOOKS[mode](allreduce_hook, ddp, zero) if overlap else reduce_scatter_hook(ddp, zero)
        ddp.register_comm_hook(None, hook)
    worst = 0.0
    for step in range(3):
        zero.zero_grad()
        backward(ddp if ddp is not None else module, rank, world, step, dtype)
        if ddp is None:
            for p in module.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= world
        if not overlap:
            zero.step()
        for p, g in zip(ref, reduced_grads(zero, rank)):
            p.grad = g.float()
        plain.step()
        if overlap:
            zero.finish_param_sync()
        got = (
            [m for m in _gathered_main(zero, rank, world)]
            if main
            else [p.detach() for p in module.parameters()]
        )
        worst = max(worst, *((a.float() - b).abs().max().item() for a, b in zip(got, ref)))
    return worst


def _gathered_main(zero: ZeroRedundancyOptimizer, rank: int, world: int) -> list[torch.Tensor]:
    """The fp32 main copies, whole on every rank: each rank's pieces summed (collective)."""
    mains = zero.main_params()
    full = [torch.zeros(p.shape) for p in zero.param_table.params]
    for s in zero.ownership.owned(rank):
        p = zero.param_table.params[s.param]
        full[s.param].view(-1)[s.start : s.stop] = mains[p].reshape(-1)
    for t in full:
        dist.all_reduce(t)
    return full


MODES = ("after_backward", "bucket_view", "reduce_scatter_hook", "main_params", *HOOKS)
"""Every mode; the overlap hooks reshard at DDP's bucket rebuild, moving quantized state in
whole blocks (:func:`~zero_functional.core.piece_state.slice_state`)."""


def _every_mode(rank: int, world: int) -> dict[str, float]:
    eager()
    out: dict[str, float] = {}
    for partition in ("sorted_greedy", "flat"):
        for mode in MODES:
            out[f"8bit {partition} {mode}"] = run_mode(rank, world, "8bit", mode, partition)
    for name in ("4bit", "fp8"):
        for mode in ("after_backward", "reduce_scatter_hook"):
            out[f"{name} flat {mode}"] = run_mode(rank, world, name, mode, "flat")
    return out


def test_every_mode_equals_plain_torchao_on_the_reduced_gradients_bitwise() -> None:
    for result in run_ranks(_every_mode, 2, timeout_s=300):
        assert result == dict.fromkeys(result, 0.0), result


# ------------------------------------------------------------------ state moves


def _stepped(cls: type, partition: str, steps: int = 2) -> tuple[list[nn.Parameter], Any]:
    """``tensors()`` and ours stepped ``steps`` times on ``grads_of`` (the same on every rank)."""
    ps = tensors()
    zero = ZeroRedundancyOptimizer(ps, cls, partition=partition, lr=1e-2)
    for t in range(steps):
        for p, g in zip(ps, grads_of(t, ps)):
            p.grad = g
        zero.step()
    return ps, zero


# ------------------------------------------------------------------ state moves and loads


def plain_stepped(cls: type, steps: int, **kw: Any) -> tuple[list[nn.Parameter], Any]:
    """``tensors()`` and the plain optimizer stepped ``steps`` times on ``grads_of``."""
    ps = tensors()
    plain = cls(ps, lr=1e-2, **kw)
    for t in range(steps):
        for p, g in zip(ps, grads_of(t, ps)):
            p.grad = g
        plain.step()
    return ps, plain


def same(a: Any, b: Any) -> bool:
    """Bitwise equal values: a quantized state's class, codes, scales and code table."""
    if type(a) is not type(b):
        return False
    if hasattr(a, "codes"):
        names = a.__tensor_flatten__()[0]
        return all(torch.equal(getattr(a, n), getattr(b, n)) for n in names)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def owned_equal(
    zero: ZeroRedundancyOptimizer, ps: list[Any], rank: int, ref: list[Any], plain: Any
) -> bool:
    """Each owned piece of ``ps`` and its state equal ``ref``'s under ``plain``, bitwise."""
    for piece in zero.ownership.owned(rank):
        k = piece.param
        if not torch.equal(piece_view(ps[k], piece), piece_view(ref[k], piece)):
            return False
        mine = zero.state[ps[k]]
        want = slice_state(plain.state[ref[k]], (0, ref[k].numel()), (piece.start, piece.stop))
        if mine.keys() != want.keys() or not all(
            same(
                mine[key].reshape(-1) if mine[key].dim() else mine[key],
                want[key].reshape(-1) if want[key].dim() else want[key],
            )
            for key in mine
        ):
            return False
    return True


def test_plain_torchao_dicts_load_at_any_world_size_and_partition_and_step_alike() -> None:
    """A plain torchao ``state_dict()`` (``lr`` a tensor) loads at 3 and 4 ranks under both
    partitions: the pieces' state is the plain one's blocks, bitwise, the groups keep a number
    ``lr``, and one more step equals the plain optimizer's third."""
    eager()
    for name in ("8bit", "4bit"):
        cls = CLASSES[name]
        ref2, plain2 = plain_stepped(cls, 2)
        ref3, plain3 = plain_stepped(cls, 3)
        saved = plain2.state_dict()
        for world, partition in ((3, "flat"), (4, "flat"), (3, "sorted_greedy")):
            for rank in range(world):
                with fake_world(world, rank):
                    ps = [nn.Parameter(p.detach().clone()) for p in ref2]
                    zero = ZeroRedundancyOptimizer(ps, cls, partition=partition, lr=1e-2)
                    zero.load_state_dict(saved)
                    assert isinstance(zero.param_groups[0]["lr"], float)
                    assert owned_equal(zero, ps, rank, ref2, plain2), (name, world, rank)
                    for p, g in zip(ps, grads_of(2, ps)):
                        p.grad = g
                    zero.step()
                    assert owned_equal(zero, ps, rank, ref3, plain3), (name, world, rank)


def _consolidated(rank: int, world: int) -> dict[str, bool]:
    """Ours stepped twice, consolidated on rank 0: its ``state_dict()`` equals the plain
    torchao one's (classes, codes, scales, ``lr`` a tensor), and it loads into a plain torchao
    optimizer whose next step equals the plain one's third."""
    eager()
    out: dict[str, bool] = {}
    for name, partition in (("8bit", "flat"), ("8bit", "sorted_greedy"), ("4bit", "flat")):
        cls = CLASSES[name]
        ps = tensors()
        zero = ZeroRedundancyOptimizer(ps, cls, partition=partition, lr=1e-2)
        for t in range(2):
            for p, g in zip(ps, grads_of(t, ps)):
                p.grad = g
            zero.step()
        zero.consolidate_state_dict(0)
        if rank:
            continue
        ref2, plain2 = plain_stepped(cls, 2)
        ref3, plain3 = plain_stepped(cls, 3)
        mine, want = zero.state_dict(), plain2.state_dict()
        case = f"{name} {partition}"
        out[f"{case} state"] = mine["state"].keys() == want["state"].keys() and all(
            mine["state"][k].keys() == want["state"][k].keys()
            and all(same(mine["state"][k][key], v) for key, v in want["state"][k].items())
            for k in want["state"]
        )
        out[f"{case} lr"] = same(mine["param_groups"][0]["lr"], want["param_groups"][0]["lr"])
        back = [nn.Parameter(p.detach().clone()) for p in ps]
        plain = cls(back, lr=1e-2)
        plain.load_state_dict(mine)
        for p, g in zip(back, grads_of(2, back)):
            p.grad = g
        plain.step()
        out[f"{case} into plain"] = all(torch.equal(a, b) for a, b in zip(back, ref3)) and all(
            same(plain.state[a][key], v)
            for a, b in zip(back, ref3)
            for key, v in plain3.state[b].items()
        )
    return out


def test_consolidated_low_bit_dicts_equal_plain_torchao_and_load_into_it() -> None:
    result = run_ranks(_consolidated, 2, timeout_s=120)[0]
    assert result == dict.fromkeys(result, True), result


def test_fp32_adamw_dicts_are_quantized_on_load_and_back_with_one_warning(caplog: Any) -> None:
    """A plain fp32 ``torch.optim.AdamW`` dict loads into ours running ``AdamW8bit`` (2 ranks,
    flat): quantized where the whole parameter is (equal to torchao quantizing it), fp32 where
    it is too small or not whole blocks; a plain ``AdamW8bit`` dict loads into ours running
    ``torch.optim.AdamW`` dequantized, bitwise. One warning each."""
    eager()
    ref, fp32 = plain_stepped(torch.optim.AdamW, 2)
    low_ps, low = plain_stepped(ao.AdamW8bit, 2)
    for rank in range(2):
        with fake_world(2, rank):
            caplog.clear()
            ps = [nn.Parameter(p.detach().clone()) for p in ref]
            zero = ZeroRedundancyOptimizer(ps, ao.AdamW8bit, partition="flat", lr=1e-2)
            zero.load_state_dict(fp32.state_dict())
            assert len([r for r in caplog.records if "quantized" in r.getMessage()]) == 1
            for piece in zero.ownership.owned(rank):
                k, got = piece.param, zero.state[ps[piece.param]]["exp_avg"]
                want = fp32.state[ref[k]]["exp_avg"].reshape(-1)[piece.start : piece.stop]
                if ref[k].numel() in (6144, 4608):  # quantized whole
                    expected = ao.AdamW8bit._subclass_zeros(want, True, 256).copy_(want)
                    assert same(got.reshape(-1), expected), piece
                else:
                    assert same(got.reshape(-1), want), piece
            caplog.clear()
            zero = ZeroRedundancyOptimizer(ps, torch.optim.AdamW, partition="flat", lr=1e-2)
            zero.load_state_dict(low.state_dict())
            assert len([r for r in caplog.records if "dequantized" in r.getMessage()]) == 1
            for piece in zero.ownership.owned(rank):
                got = zero.state[ps[piece.param]]["exp_avg"].reshape(-1)
                want = dequantized(low.state[low_ps[piece.param]]["exp_avg"])
                assert torch.equal(got, want[piece.start : piece.stop]), piece


def test_quantized_state_cut_off_its_blocks_is_refused_with_the_reason() -> None:
    """A dict of 256-element blocks into ours in blocks of 128 under ``"flat"``: a cut at an
    odd multiple of 128 would split a saved block; the load is refused, saying so."""
    eager()
    _, plain = plain_stepped(ao.AdamW8bit, 1)
    refused = []
    for rank in range(3):
        with fake_world(3, rank):
            ps = tensors()
            zero = ZeroRedundancyOptimizer(
                ps, ao.AdamW8bit, partition="flat", lr=1e-2, block_size=128
            )
            try:
                zero.load_state_dict(plain.state_dict())
            except ValueError as e:
                assert "do not start and stop on its blocks of 256" in str(e)
                refused.append(rank)
    assert refused


# ------------------------------------------------------------------ sharded checkpoints


def _flat_state(zero: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """Rank 0's consolidated state, picklable: a quantized value as its class name and inner
    tensors (codes as bytes, scales, code table), others as they are (collective)."""
    zero.consolidate_state_dict(0)
    if dist.get_rank():
        return {}
    out: dict[str, Any] = {}
    for k, entry in zero.state_dict()["state"].items():
        for key, v in entry.items():
            if hasattr(v, "codes"):
                names = v.__tensor_flatten__()[0]
                # fp8 codes travel (between processes) as their bytes, bitwise
                inner = [getattr(v, n).clone() for n in names]
                inner = [t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in inner]
                out[f"{k}.{key}"] = (type(v).__name__, inner)
            else:
                out[f"{k}.{key}"] = v
    return out


def _lowbit_steps(module: nn.Module, zero: ZeroRedundancyOptimizer, steps: range) -> None:
    """``steps`` of ``zero`` on gradients of the step's number (the same on every rank)."""
    for t in steps:
        g = torch.Generator().manual_seed(500 + t)
        for p in module.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        zero.step()


def _save_lowbit(
    rank: int, world: int, path: str, name: str
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Two steps of ``CLASSES[name]`` under ``"flat"`` at ``world`` ranks, saved; the
    consolidated state then, and the parameters after a third step."""
    eager()
    module = model()
    zero = ZeroRedundancyOptimizer(list(module.parameters()), CLASSES[name], partition="flat")
    _lowbit_steps(module, zero, range(2))
    checkpoint.save(path, model=module, optimizer=zero)
    state = _flat_state(zero)
    _lowbit_steps(module, zero, range(2, 3))
    return state, [p.detach().clone() for p in module.parameters()]


def _load_lowbit(
    rank: int, world: int, path: str, saved: tuple[dict[str, Any], list[torch.Tensor]], name: str
) -> dict[str, bool]:
    """The checkpoint loaded at ``world`` ranks under each partition into a model of other
    values: the consolidated state equals the saving run's, bitwise, and a third step its."""
    eager()
    out: dict[str, bool] = {}
    for partition in ("flat", "sorted_greedy"):
        torch.manual_seed(1)
        module = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 48), nn.Linear(48, 4))
        zero = ZeroRedundancyOptimizer(
            list(module.parameters()), CLASSES[name], partition=partition
        )
        checkpoint.load(path, model=module, optimizer=zero)
        state = _flat_state(zero)
        if rank == 0:
            out[f"{partition} state"] = state.keys() == saved[0].keys() and all(
                _same_flat(state[k], v) for k, v in saved[0].items()
            )
        _lowbit_steps(module, zero, range(2, 3))
        out[f"{partition} step"] = all(
            torch.equal(a, b) for a, b in zip(module.parameters(), saved[1])
        )
    return out


def _same_flat(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else bool(a == b)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_sharded_checkpoints_of_quantized_state_reshard_3_to_2_and_4_bitwise(
    tmp_path: Path, name: str
) -> None:
    """Saved at 3 ranks under ``"flat"`` (6144- and 4608-element weights quantized, cut on
    their blocks; biases and a 192-element weight in fp32), loaded at 2 and 4 under both
    partitions: the consolidated state is the saving run's, bitwise, and training goes on as
    it would have."""
    spec = LOW_BIT[f"adamw{name}"]
    path = str(tmp_path / "ck")
    saved = run_ranks(_save_lowbit, 3, path, name, timeout_s=120)[0]
    keys = storage.read_keys(path)
    codes = keys["quantized.0.weight.exp_avg.codes"]
    assert codes[0] == (6144 * spec.code_bits // 8,) and codes[1].itemsize == 1, codes
    assert keys["quantized.0.weight.exp_avg.scale"] == ((6144 // spec.block,), torch.float32)
    assert "state.0.weight.exp_avg" not in keys and "state.0.bias.exp_avg" in keys
    assert storage.read_objects(path, ["format"])["format"] == "zero_functional.checkpoint/2"
    assert any(isinstance(v, tuple) and v[0].startswith("OptimState") for v in saved[0].values())
    assert any(isinstance(v, torch.Tensor) and v.dim() for v in saved[0].values())
    for world in (2, 4):
        for result in run_ranks(_load_lowbit, world, path, saved, name, timeout_s=120):
            assert result == dict.fromkeys(result, True), (name, world, result)


def test_dcp_stateful_refuses_quantized_state_naming_checkpoint_save() -> None:
    with fake_world(2, 0):
        module = model()
        zero = ZeroRedundancyOptimizer(list(module.parameters()), ao.AdamW8bit)
        with pytest.raises(ValueError, match=r"AdamW8bit.*zero_functional\.checkpoint\.save"):
            checkpoint.stateful(module, zero)
