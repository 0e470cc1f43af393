"""Compressed collectives' keywords refused at the call, before anything is built (issue 41)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from zero_functional import ZeroRedundancyOptimizer, hooks

CHOICES = r"None or one of torch\.bfloat16, torch\.float16, torch\.int8, torch\.float8_e4m3fn"


@pytest.mark.parametrize("bad", [torch.float32, torch.uint8, torch.float64])
def test_every_other_wire_dtype_is_refused_by_each_hook(bad: torch.dtype) -> None:
    allreduce = default_hooks.allreduce_hook
    with pytest.raises(ValueError, match=f"wire_dtype must be {CHOICES}; got {bad}"):
        hooks.reduce_scatter_hook(None, None, wire_dtype=bad)  # type: ignore[arg-type]
    for make in (hooks.hook_with_zero_step, hooks.hook_with_zero_step_interleaved):
        with pytest.raises(ValueError, match=f"wire_dtype must be {CHOICES}"):
            make(allreduce, None, None, wire_dtype=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got 'int8'"):
        hooks.reduce_scatter_hook(None, None, wire_dtype="int8")  # type: ignore[arg-type]


def test_a_custom_hook_keeps_its_own_reduction() -> None:
    with pytest.raises(ValueError, match="custom hook .*'fp16_compress_hook'.*compress there"):
        hooks.hook_with_zero_step(
            default_hooks.fp16_compress_hook,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            wire_dtype=torch.int8,
        )


def test_gather_dtype_is_checked_with_the_other_inputs() -> None:
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=f"gather_dtype must be {CHOICES}; got torch.float32"):
        ZeroRedundancyOptimizer([w], torch.optim.Adam, gather_dtype=torch.float32)
    with pytest.raises(ValueError, match="pass store_param_remainders=False"):
        ZeroRedundancyOptimizer(
            [w], torch.optim.Adam, gather_dtype=torch.int8, store_param_remainders=True
        )
    with pytest.raises(ValueError, match=r"gather_dtype \(main copies\) needs an elementwise"):
        ZeroRedundancyOptimizer([w], torch.optim.LBFGS, gather_dtype=torch.int8)


def test_a_wire_with_a_codec_reduces_every_buffer_by_an_encoded_exchange() -> None:
    from zero_functional import comm
    from zero_functional.comm.collectives import AllGather, Exchange, PerRun, ReduceScatter
    from zero_functional.comm.testing import fake_world
    from zero_functional.core.ownership import Run
    from zero_functional.core.plans import BufferPlan

    runs = tuple(Run(4 * r, 4 * r + 4, r) for r in range(4))
    even = BufferPlan("reduce_scatter+all_gather", runs, 4)
    uneven = BufferPlan("reduce+broadcast", runs, None)
    with fake_world(4) as group:
        plain = comm.Wire(group, threaded=False)
        coded = comm.Wire(group, threaded=False, codec=comm.Codec(torch.int8))
        cpu = torch.device("cpu")
        assert [type(c) for c in plain.choose(even, cpu)] == [ReduceScatter, AllGather]
        assert [type(c) for c in coded.choose(even, cpu)] == [Exchange, AllGather]
        assert [type(c) for c in coded.choose(uneven, cpu)] == [Exchange, PerRun]
