"""The frameworks, each run for real: Lightning, Fabric, Accelerate, the Transformers Trainer, DCP.

Each multi-process test starts its ranks once with :func:`zero_functional.app.launch.run_ranks`
(forked: the frameworks are imported once, here) and runs every case inside. The frameworks
that launch processes of their own (Lightning's and Fabric's ``ddp``, Accelerate, the
Transformers Trainer) find a torchrun-like environment in each rank and use the process group
that is already there, as they do under ``torchrun``. A test is skipped only where its
framework is not installed; ``make test`` installs the ``integrations`` extra.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zero_functional import checkpoint
from zero_functional.app.launch import LaunchError
from zero_functional.optimizer import ZeroRedundancyOptimizer

from tests.dist.test_checkpoint import Net, consolidated, groups, train
from tests.helpers import run_ranks

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
            app = checkpoint.stateful(model, opt)
            for attempt in ("into a fresh optimizer", "into one that has stepped since"):
                dcp.load({"app": app}, checkpoint_id=f"{root}/{saved_as}")
                _state_equal(before, consolidated(opt), f"{label}, {attempt}")
                after = _model_state(model)
                assert after.keys() == model_before.keys(), label
                assert all(torch.equal(after[k], v) for k, v in model_before.items()), label
                train(model, opt, rank, world_size, range(3, 4))
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


def _dcp_before_first_step(rank: int, world_size: int, root: str) -> dict[str, bool]:
    """A ``dcp.save`` through ``stateful`` before the first step writes zeros (never memory no
    one wrote, issue 34): loaded, the next step equals a fresh optimizer's, bitwise."""
    out: dict[str, bool] = {}
    for partition in PARTITIONS:
        model = Net()
        opt = ZeroRedundancyOptimizer(groups(model), torch.optim.Adam, partition=partition, lr=0.01)
        path = f"{root}/{partition}-fresh"
        dcp.save({"app": checkpoint.stateful(model, opt)}, checkpoint_id=path)
        meta = dcp.FileSystemReader(path).read_metadata()
        out[f"{partition} steps written"] = any("step" in k for k in meta.state_dict_metadata)
        loaded_model = Net()
        loaded = ZeroRedundancyOptimizer(
            groups(loaded_model), torch.optim.Adam, partition=partition, lr=0.01
        )
        dcp.load({"app": checkpoint.stateful(loaded_model, loaded)}, checkpoint_id=path)
        state = consolidated(loaded)["state"]
        out[f"{partition} zeros"] = all(
            not torch.any(v) for s in state.values() for v in s.values()
        )
        fresh_model = Net()
        fresh = ZeroRedundancyOptimizer(
            groups(fresh_model), torch.optim.Adam, partition=partition, lr=0.01
        )
        train(loaded_model, loaded, rank, world_size, range(2))
        train(fresh_model, fresh, rank, world_size, range(2))
        out[f"{partition} steps like a fresh one"] = all(
            torch.equal(a, b) for a, b in zip(loaded_model.parameters(), fresh_model.parameters())
        )
    return out


def test_dcp_stateful_save_before_the_first_step_loads_as_a_fresh_optimizer(
    tmp_path: Path,
) -> None:
    for got in run_ranks(_dcp_before_first_step, 2, str(tmp_path), timeout_s=120):
        assert all(got.values()), got


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


# ---------------------------------------------------------------- the frameworks' shared parts


def _torchrun_env(rank: int, world_size: int) -> None:
    """What torchrun sets (run_ranks has set MASTER_ADDR and MASTER_PORT): the frameworks then
    use the process group that exists instead of starting processes."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        NODE_RANK="0",
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )


def _data(n: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 7, generator=g), torch.randn(n, 3, generator=g))


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _zero(model: nn.Module, partition: str) -> ZeroRedundancyOptimizer:
    return ZeroRedundancyOptimizer(
        groups(model), torch.optim.Adam, partition=partition, lr=0.01, amsgrad=True
    )


# ---------------------------------------------------------------- PyTorch Lightning and Fabric


def _fabric_epochs(fabric: Any, loader: Any, model: Any, opt: Any, todo: range) -> None:
    for _ in todo:
        for batch in loader:
            opt.zero_grad()
            fabric.backward(_loss(model, batch))
            opt.step()


def _lightning_worker(rank: int, world_size: int, root: str) -> dict[str, float]:
    """Trainer and Fabric (strategy "ddp"): 2 epochs, save, resume for 1 == 3 epochs."""
    import lightning as L

    _torchrun_env(rank, world_size)

    class Lit(L.LightningModule):
        def __init__(self, partition: str) -> None:
            super().__init__()
            self.net = Net()
            self.partition = partition

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return _loss(self.net, batch)

        def configure_optimizers(self) -> ZeroRedundancyOptimizer:
            return _zero(self.net, self.partition)

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(_data(), batch_size=2, shuffle=True)

    def trainer(epochs: int) -> L.Trainer:
        return L.Trainer(
            strategy="ddp",
            accelerator="cpu",
            devices=world_size,
            max_epochs=epochs,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            logger=False,
            default_root_dir=root,
        )

    out: dict[str, float] = {}
    for partition in PARTITIONS:
        path = f"{root}/lightning-{partition}.ckpt"
        straight = Lit(partition)
        trainer(3).fit(straight)
        first = Lit(partition)
        two = trainer(2)
        two.fit(first)
        two.save_checkpoint(path)
        resumed = Lit(partition)
        trainer(3).fit(resumed, ckpt_path=path)
        out[f"Trainer {partition}"] = _max_diff(straight, resumed)
        assert isinstance(resumed.optimizers(use_pl_optimizer=False), ZeroRedundancyOptimizer)

        # Fabric: the same, with Fabric's own save and load
        fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy="ddp")
        fabric.launch()
        # not shuffled: Fabric's loader sets its sampler's epoch by counting its own iterations
        loader = fabric.setup_dataloaders(DataLoader(_data(), batch_size=2))
        path = f"{root}/fabric-{partition}.ckpt"

        model = Net()
        model, opt = fabric.setup(model, _zero(model, partition))
        _fabric_epochs(fabric, loader, model, opt, range(2))
        fabric.save(path, {"model": model, "optimizer": opt, "epoch": 2})
        _fabric_epochs(fabric, loader, model, opt, range(2, 3))
        again = Net()
        nn.init.zeros_(again.a.weight)
        again, opt2 = fabric.setup(again, _zero(again, partition))
        state = {"model": again, "optimizer": opt2, "epoch": 0}
        fabric.load(path, state)
        assert state["epoch"] == 2
        _fabric_epochs(fabric, loader, again, opt2, range(2, 3))
        out[f"Fabric {partition}"] = _max_diff(model, again)
    return out


def test_lightning_trainer_and_fabric_resume_equals_uninterrupted(tmp_path: Path) -> None:
    pytest.importorskip(
        "lightning", reason="Lightning is not installed (pip install .[integrations])"
    )
    results = run_ranks(_lightning_worker, 2, str(tmp_path), start_method="fork", timeout_s=300)
    for result in results:
        assert len(result) == 4, result
        for label, diff in result.items():
            # Bitwise by construction (a resumed run does the uninterrupted run's arithmetic on the
            # same values); the bound is kept.
            assert diff < 1e-6, (label, diff)


# ---------------------------------------------------------------- Hugging Face Accelerate


def _accelerate_steps(
    accelerator: Any, model: nn.Module, opt: Any, rank: int, steps: range
) -> None:
    world_size = accelerator.num_processes
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 7, generator=g), torch.randn(8, 3, generator=g)
        per = 8 // world_size
        batch = (x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        opt.zero_grad()
        accelerator.backward(_loss(model, batch))
        opt.step()


def _accelerate_worker(rank: int, world_size: int, root: str) -> dict[str, float]:
    """prepare(model, zero) as it is; register; save_state at step 2; load_state; go on."""
    from accelerate import Accelerator

    from zero_functional.integrations import accelerate

    _torchrun_env(rank, world_size)
    out: dict[str, float] = {}
    for partition in PARTITIONS:
        path = f"{root}/accelerate-{partition}"
        accelerator = Accelerator(cpu=True)
        net = Net()
        model, opt = accelerator.prepare(net, _zero(net, partition))
        accelerate.register(accelerator, opt)
        _accelerate_steps(accelerator, model, opt, rank, range(2))
        accelerator.save_state(path)
        saved = consolidated(opt.optimizer)
        _accelerate_steps(accelerator, model, opt, rank, range(2, 4))

        again = Net()
        nn.init.zeros_(again.a.weight)
        resumed = Accelerator(cpu=True)
        model2, opt2 = resumed.prepare(again, _zero(again, partition))
        accelerate.register(resumed, opt2)
        resumed.load_state(path)
        _accelerate_steps(resumed, model2, opt2, rank, range(2, 4))
        out[partition] = _max_diff(model, model2)

        # the file is torch's format: a plain torch.optim.Adam loads it
        plain = torch.optim.Adam(groups(Net()), lr=0.01, amsgrad=True)
        plain.load_state_dict(torch.load(f"{path}/optimizer.bin", weights_only=True))
        _state_equal(saved, plain.state_dict(), f"optimizer.bin ({partition}) in torch.optim.Adam")
    return out


def test_accelerate_save_state_and_load_state_resume_exactly(tmp_path: Path) -> None:
    pytest.importorskip(
        "accelerate", reason="Accelerate is not installed (pip install .[integrations])"
    )
    for result in run_ranks(
        _accelerate_worker, 2, str(tmp_path), start_method="fork", timeout_s=180
    ):
        assert result.keys() == set(PARTITIONS), result
        for partition, diff in result.items():
            # Bitwise by construction (a resumed run does the uninterrupted run's arithmetic on the
            # same values); the bound is kept.
            assert diff < 1e-6, (partition, diff)


# ---------------------------------------------------------------- Hugging Face Transformers


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """12 sequences of 8 tokens out of 32, the labels the inputs (a language model's loss)."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 32, (12, 8), generator=torch.Generator().manual_seed(2))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train_gpt2(
    partition: str,
    output_dir: str,
    *,
    callback: bool,
    resume: str | None = None,
    best: bool = False,
) -> nn.Module:
    """A 1-layer GPT-2 built from its config; 6 steps of 2 x 2 sequences; a checkpoint every 2."""
    from torch.optim.lr_scheduler import LambdaLR
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from zero_functional.integrations import ZeroTrainerCallback

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, partition=partition, lr=0.01
    )
    # best: evaluate every 2 steps and save only after a new best loss (decided after on_evaluate)
    when: dict[str, Any] = (
        {"save_strategy": "best", "eval_strategy": "steps", "eval_steps": 2}
        if best
        else {"save_strategy": "steps", "save_steps": 2}
    )
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        max_steps=6,
        **when,
        metric_for_best_model="loss",
        logging_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_Tokens(),
        eval_dataset=_Tokens() if best else None,
        optimizers=(zero, LambdaLR(zero, lambda step: 1.0 / (1 + step))),
        callbacks=[ZeroTrainerCallback()] if callback else [],
    )
    trainer.train(resume_from_checkpoint=resume)
    return model


def _trainer_worker(rank: int, world_size: int, root: str) -> dict[str, float]:
    """6 steps straight vs. resumed from checkpoint-4 (mid-epoch: 3 steps an epoch); then
    save_strategy="best", whose saves are decided after each evaluation."""
    _torchrun_env(rank, world_size)
    out: dict[str, float] = {}
    for partition in PARTITIONS:
        straight = _train_gpt2(partition, f"{root}/{partition}", callback=True)
        resumed = _train_gpt2(
            partition,
            f"{root}/{partition}-resumed",
            callback=True,
            resume=f"{root}/{partition}/checkpoint-4",
        )
        out[partition] = _max_diff(straight, resumed)
    _train_gpt2("flat", f"{root}/best", callback=True, best=True)
    saved = sorted(os.listdir(f"{root}/best"))
    assert saved and all(os.path.exists(f"{root}/best/{c}/optimizer.pt") for c in saved), saved
    return out


def _trainer_without_callback(rank: int, world_size: int, root: str) -> None:
    _torchrun_env(rank, world_size)
    _train_gpt2("flat", root, callback=False)


def test_transformers_trainer_checkpoints_resume_exactly_with_the_callback(
    tmp_path: Path,
) -> None:
    pytest.importorskip(
        "transformers", reason="Transformers is not installed (pip install .[integrations])"
    )
    for result in run_ranks(_trainer_worker, 2, str(tmp_path), start_method="fork", timeout_s=240):
        assert result.keys() == set(PARTITIONS), result
        for partition, diff in result.items():
            # Bitwise by construction (a resumed run does the uninterrupted run's arithmetic on the
            # same values); the bound is kept.
            assert diff < 1e-6, (partition, diff)


def test_transformers_trainer_without_the_callback_fails_fast_naming_it(tmp_path: Path) -> None:
    pytest.importorskip(
        "transformers", reason="Transformers is not installed (pip install .[integrations])"
    )
    with pytest.raises(LaunchError) as info:
        # a hang would end at timeout_s as "gave no result": the first failure must be rank 0's
        run_ranks(_trainer_without_callback, 2, str(tmp_path), start_method="fork", timeout_s=120)
    first = info.value.failures[0]
    assert first.rank == 0 and first.reason.startswith("raised RuntimeError"), str(info.value)
    assert "ZeroTrainerCallback" in first.traceback, str(info.value)
