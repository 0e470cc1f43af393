"""torchao's low-bit AdamW (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``) as ``optimizer_class``
(issue 31): block-aligned ``"flat"`` cuts, the quantized-or-not decision taken on the whole
parameter, the state bytes per rank, state dicts, in one process (every mode on ranks:
``tests/dist/test_lowbit.py``).

The steps run eagerly (``torch.compiler.set_stance("force_eager")``): torchao compiles one graph
per tensor shape, ~5-15 s each on CPU, and a piece has other shapes than its parameter. Eager,
every comparison here is bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from zero_functional import ZeroRedundancyOptimizer, checkpoint
from zero_functional.comm.testing import fake_world
from zero_functional.core.layout import piece_view
from zero_functional.core.piece_state import slice_state
from zero_functional.functional.registry import update_block, update_kind

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


def model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 48), nn.Linear(48, 4)).to(
        dtype
    )


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


def test_dcp_stateful_refuses_quantized_state_naming_checkpoint_save() -> None:
    with fake_world(2, 0):
        module = model()
        zero = ZeroRedundancyOptimizer(list(module.parameters()), ao.AdamW8bit)
        with pytest.raises(ValueError, match=r"AdamW8bit.*zero_functional\.checkpoint\.save"):
            checkpoint.stateful(module, zero)
