"""The frameworks, each run for real: Lightning, Fabric, Accelerate, the Transformers Trainer, DCP.

Each multi-process test starts its ranks once with :func:`zero_functional.launch.run_ranks`
(forked: the frameworks are imported once, here) and runs every case inside. The frameworks
that launch processes of their own (Lightning's and Fabric's ``ddp``, Accelerate, the
Transformers Trainer) find a torchrun-like environment in each rank and use the process group
that is already there, as they do under ``torchrun``. A test is skipped only where its
framework is not installed; ``make test`` installs the ``integrations`` extra.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from zero_functional import checkpoint
from zero_functional.launch import run_ranks
from zero_functional.optimizer import ZeroRedundancyOptimizer

from tests.test_checkpoint import Net, consolidated, groups, train

PARTITIONS = ("sorted_greedy", "flat")


def test_importing_integrations_imports_no_framework() -> None:
    code = (
        "import sys, zero_functional.integrations as i; "
        "assert 'ZeroTrainerCallback' in i.__all__; "
        "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'accelerate', "
        "'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ---------------------------------------------------------------- torch.distributed.checkpoint


def _state_equal(a: dict[str, Any], b: dict[str, Any], label: str) -> None:
    """Two optimizer state dicts equal bitwise (values, dtypes, groups)."""
    assert a["param_groups"] == b["param_groups"], label
    assert a["state"].keys() == b["state"].keys(), label
    for i, s in a["state"].items():
        assert s.keys() == b["state"][i].keys(), (label, i)
        for k, v in s.items():
            w = b["state"][i][k]
            assert v.dtype == w.dtype and torch.equal(v, w), (label, i, k)


def _model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _dcp_save_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Train 3 steps under each partition; dcp.save; the consolidated state is the reference."""
    out: dict[str, Any] = {}
    for partition in PARTITIONS:
        model = Net()
        opt = ZeroRedundancyOptimizer(
            groups(model), torch.optim.Adam, partition=partition, lr=0.01, amsgrad=True
        )
        train(model, opt, rank, world_size, range(3))
        dcp.save({"app": checkpoint.stateful(model, opt)}, checkpoint_id=f"{root}/{partition}")
        out[partition] = (consolidated(opt), _model_state(model))
    return out


def _dcp_load_worker(rank: int, world_size: int, root: str, reference: dict[str, Any]) -> int:
    """Load each checkpoint under each partition; compare with the saving run, bitwise."""
    cases = 0
    for saved_as in PARTITIONS:
        before, model_before = reference[saved_as]
        for partition in PARTITIONS:
            label = f"saved at 3 ranks {saved_as}, loaded at {world_size} {partition}"
            model = Net()
            nn.init.zeros_(model.a.weight)  # something to overwrite
            opt = ZeroRedundancyOptimizer(
                groups(model), torch.optim.Adam, partition=partition, lr=0.01, amsgrad=True
            )
            dcp.load({"app": checkpoint.stateful(model, opt)}, checkpoint_id=f"{root}/{saved_as}")
            _state_equal(before, consolidated(opt), label)
            after = _model_state(model)
            assert after.keys() == model_before.keys(), label
            assert all(torch.equal(after[k], v) for k, v in model_before.items()), label
            cases += 1
        # torch's own state dict of a plain optimizer reads the same checkpoint
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        plain_model = Net()
        plain = torch.optim.Adam(groups(plain_model), lr=0.01, amsgrad=True)
        model_sd, optim_sd = get_state_dict(plain_model, plain)
        dcp.load(
            {"app": {"model": model_sd, "optimizer": optim_sd}}, checkpoint_id=f"{root}/{saved_as}"
        )
        set_state_dict(plain_model, plain, model_state_dict=model_sd, optim_state_dict=optim_sd)
        _state_equal(before, plain.state_dict(), f"saved {saved_as}, loaded into torch.optim.Adam")
        cases += 1
    return cases


def test_dcp_stateful_saves_shares_and_loads_at_other_world_sizes_and_partitions(
    tmp_path: Path,
) -> None:
    reference = run_ranks(_dcp_save_worker, 3, str(tmp_path), start_method="fork", timeout_s=120)
    for world_size in (2, 4):
        counts = run_ranks(
            _dcp_load_worker,
            world_size,
            str(tmp_path),
            reference[0],
            start_method="fork",
            timeout_s=120,
        )
        assert counts == [6] * world_size
    # each rank wrote its own pieces: under "flat" a weight's state is in several ranks' files
    metadata = dcp.FileSystemReader(str(tmp_path / "flat")).read_metadata()
    key = "app.optimizer.state.a.weight.exp_avg"
    files = {i.relative_path for k, i in metadata.storage_data.items() if k.fqn == key}
    assert len(files) > 1, files
