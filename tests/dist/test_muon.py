"""Muon with AdamW in one ZeroRedundancyOptimizer: a class per param group (issue 30).

Against DDP-style averaged gradients + plain ``torch.optim.Muon`` + ``torch.optim.AdamW`` on
the same data: bitwise at 2 ranks, step after backward, under both partitions (AdamW's reference is
``fused=True``, the kernel the functional core runs on the CPU); with ``reduce_scatter_hook``,
against DDP + the plain optimizers, bitwise too. One launch runs every case (parity, the state
dict, the errors); test_muon_modes runs overlap mode, the bytes, 3 ranks and resharding.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from zero_functional.hooks import reduce_scatter_hook
from zero_functional.optimizer import ZeroRedundancyOptimizer

from tests.helpers import average_grads, consolidated, run_ranks, train_both

VOCAB, WIDTH, STEPS = 32, 16, 20


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        h = h + torch.cumsum(self.mix(h), dim=1) / (1 + torch.arange(h.shape[1])[:, None])
        return x + self.down(torch.tanh(self.up(h)))


class TinyGPT(nn.Module):
    """Embeddings, a few blocks of 2-D Linear weights with biases and norms, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def split(model: TinyGPT) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The blocks' matrices (Muon) and the rest (AdamW), in the model's order."""
    matrices = [p for p in model.blocks.parameters() if p.ndim == 2]
    ids = {id(p) for p in matrices}
    return matrices, [p for p in model.parameters() if id(p) not in ids]


def recipe(model: TinyGPT, partition: str, **options: Any) -> ZeroRedundancyOptimizer:
    matrices, rest = split(model)
    return ZeroRedundancyOptimizer(
        [{"params": matrices, "optimizer_class": torch.optim.Muon, "lr": 0.02}, {"params": rest}],
        optimizer_class=torch.optim.AdamW,
        partition=partition,
        lr=3e-4,
        weight_decay=0.1,
        **options,
    )


def ddp_backward(ddp: nn.Module, rank: int, world_size: int, step: int) -> None:
    """This rank's slice of step ``step``'s batch through ``ddp``: DDP (or its hook) averages."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (4 * world_size, 9), generator=g)
    mine = tokens[4 * rank : 4 * (rank + 1)]
    logits = ddp(mine[:, :-1])
    nn.functional.cross_entropy(logits.reshape(-1, VOCAB), mine[:, 1:].reshape(-1)).backward()


def backward(model: nn.Module, rank: int, world_size: int, step: int) -> None:
    """:func:`ddp_backward` through a plain module, then DDP's average by hand."""
    ddp_backward(model, rank, world_size, step)
    average_grads(model, world_size)


def exact(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def _error(fn: Any) -> str:
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for partition in ("flat", "sorted_greedy"):
        model, ref_model = TinyGPT(), TinyGPT()
        zero = recipe(model, partition)
        matrices, rest = split(ref_model)
        plain = [
            torch.optim.Muon(matrices, lr=0.02),
            # fused: the kernel the functional core runs AdamW through on the CPU (the
            # for-loop one differs in the last bit, as for one class for all groups)
            torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.1, fused=True),
        ]
        train_both([(model, zero), (ref_model, plain)], rank, world_size, STEPS, backward)
        out[f"{partition} parity"] = exact(model, ref_model)
        out[f"{partition} muon owned whole"] = all(
            s.stop - s.start == p.numel()
            for s in zero.ownership.owned(rank)
            if (p := zero.param_table.params[s.param]).ndim == 2 and s.param < len(matrices)
        )
        # the consolidated dict: torch's format, classes by name, weights_only-loadable
        sd = consolidated(zero, rank)
        if rank == 0:
            assert sd is not None
            buf = io.BytesIO()
            torch.save(sd, buf)
            buf.seek(0)
            loaded = torch.load(buf, weights_only=True)
            out[f"{partition} classes"] = [g["optimizer_class"] for g in loaded["param_groups"]]
            reference = [o.state_dict() for o in plain]
            out[f"{partition} state"] = all(
                torch.equal(loaded["state"][k]["momentum_buffer"], v["momentum_buffer"])
                for k, v in reference[0]["state"].items()
            ) and all(
                torch.equal(loaded["state"][k + len(matrices)][key], t)
                for k, v in reference[1]["state"].items()
                for key, t in v.items()
            )
            wrong = copy.deepcopy(loaded)
            wrong["param_groups"][0]["optimizer_class"] = "torch.optim.AdamW"
            out[f"{partition} wrong class"] = _error(lambda z=zero, w=wrong: z.load_state_dict(w))
        # at another world size: rank 0 alone loads the 2-rank dict and gives it back
        alone = dist.new_group([0])
        if rank == 0:
            other = recipe(
                TinyGPT(),
                "flat" if partition == "sorted_greedy" else "sorted_greedy",
                process_group=alone,
            )
            other.load_state_dict(loaded)
            other.consolidate_state_dict(0)
            again = other.state_dict()
            out[f"{partition} reloaded"] = (
                all(
                    torch.equal(again["state"][k][key], t)
                    for k, v in loaded["state"].items()
                    for key, t in v.items()
                )
                and again["param_groups"] == loaded["param_groups"]
            )
    # errors, on every rank, before anything changes
    model = TinyGPT()
    matrices, rest = split(model)
    bias = next(p for p in rest if p.ndim == 1)
    out["1-D in Muon"] = _error(
        lambda: ZeroRedundancyOptimizer(
            [
                {"params": [p for p in rest if p is not bias]},
                {"params": [*matrices, bias], "optimizer_class": torch.optim.Muon},
            ],
            torch.optim.AdamW,
        )
    )
    out["unknown hyperparameter"] = _error(
        lambda: ZeroRedundancyOptimizer(
            [
                {"params": matrices, "optimizer_class": torch.optim.Muon, "betas": (0.9, 0.95)},
                {"params": rest},
            ],
            torch.optim.AdamW,
        )
    )
    # reduce_scatter_hook: each matrix's gradient reduced onto its owner only, against DDP +
    # the plain optimizers (both divide, then sum, as DDP does)
    for partition in ("flat", "sorted_greedy"):
        ddp, ref = DDP(TinyGPT()), DDP(TinyGPT())
        zero = recipe(ddp.module, partition)
        ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
        matrices, rest = split(ref.module)
        plain = [
            torch.optim.Muon(matrices, lr=0.02),
            torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.1, fused=True),
        ]
        train_both([(ddp, zero), (ref, plain)], rank, world_size, STEPS, ddp_backward)
        out[f"{partition} reduce_scatter_hook parity"] = exact(ddp, ref)
    # a bf16 model with fp32 main parameters: Muon and AdamW step the fp32 main pieces, as
    # the plain optimizers stepping fp32 copies of the bf16 weights with fp32 gradients do
    for partition in ("flat", "sorted_greedy"):
        model, ref_model = TinyGPT().to(torch.bfloat16), TinyGPT().to(torch.bfloat16)
        start = [p.detach().clone() for p in model.parameters()]
        zero = recipe(model, partition, main_params_dtype=torch.float32)
        ref_params = [*split(ref_model)[0], *split(ref_model)[1]]
        main = [p.detach().float().requires_grad_() for p in ref_params]
        n = len(split(ref_model)[0])
        plain = [
            torch.optim.Muon(main[:n], lr=0.02),
            torch.optim.AdamW(main[n:], lr=3e-4, weight_decay=0.1, fused=True),
        ]
        for step in range(STEPS):
            zero.zero_grad()
            ref_model.zero_grad()
            backward(model, rank, world_size, step)
            backward(ref_model, rank, world_size, step)
            zero.step()
            for m, p in zip(main, ref_params, strict=True):
                m.grad = p.grad.float()
            for o in plain:
                o.step()
            with torch.no_grad():
                for m, p in zip(main, ref_params, strict=True):
                    p.copy_(m)
        out[f"{partition} fp32 main parity"] = exact(model, ref_model) and not all(
            torch.equal(a, b) for a, b in zip(start, model.parameters())
        )
        out[f"{partition} fp32 main state"] = sorted(
            {str(v.dtype) for s in zero.state.values() for v in s.values() if v.dim() > 0}
        )
    return out


def _schedules_clipping_checkpoints(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """An LR schedule per group and ``clip_grad_norm_``, against the plain optimizers with the
    same schedules and torch's clipping; then a sharded checkpoint saved under ``"flat"``
    loads under ``"sorted_greedy"`` with the same state, classes by name."""
    from zero_functional import checkpoint

    def schedules(opt: torch.optim.Optimizer | list[torch.optim.Optimizer]) -> list[Any]:
        decay, flat = (lambda s: 0.5**s), (lambda s: 1.0 / (1 + s))
        if isinstance(opt, list):  # the plain Muon, then the plain AdamW
            return [torch.optim.lr_scheduler.LambdaLR(o, f) for o, f in zip(opt, (decay, flat))]
        return [torch.optim.lr_scheduler.LambdaLR(opt, [decay, flat])]

    model, ref_model = TinyGPT(), TinyGPT()
    zero = recipe(model, "flat")
    matrices, rest = split(ref_model)
    plain = [
        torch.optim.Muon(matrices, lr=0.02),
        torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.1, fused=True),
    ]
    ours_s, plain_s = schedules(zero), schedules(plain)
    norm_errors: list[float] = []
    for step in range(STEPS // 2):
        for o in (zero, *plain):
            o.zero_grad()
        backward(model, rank, world_size, step)
        backward(ref_model, rank, world_size, step)
        total = zero.clip_grad_norm_(0.5)
        # the norms are the same sum of squares added in another order: they may differ in
        # their last bits, which Muon's bf16 Newton-Schulz turns into 1e-4 (issue 42 item 0).
        # So the norm is checked on its own (its bound below), and the reference is clipped
        # with our total: then the updates must agree bitwise.
        ref_params = list(ref_model.parameters())
        ref_total = torch.nn.utils.get_total_norm([p.grad for p in ref_params])
        norm_errors.append(abs(total.item() - ref_total.item()) / ref_total.item())
        torch.nn.utils.clip_grads_with_norm_(ref_params, 0.5, total)
        for o in (zero, *plain):
            o.step()
        for s in (*ours_s, *plain_s):
            s.step()
    out: dict[str, Any] = {
        "lrs": [g["lr"] for g in zero.param_groups],
        "plain lrs": [o.param_groups[0]["lr"] for o in plain],
        "norm errors": norm_errors,
        "elements": sum(p.numel() for p in model.parameters()),
        "max diff": max(
            (a - b).abs().max().item()
            for a, b in zip(model.parameters(), ref_model.parameters(), strict=True)
        ),
    }
    checkpoint.save(path, model=model, optimizer=zero)
    saved = consolidated(zero, rank)
    other_model = TinyGPT()
    other = recipe(other_model, "sorted_greedy")
    checkpoint.load(path, model=other_model, optimizer=other)
    loaded = consolidated(other, rank)
    assert saved is not None and loaded is not None
    out["checkpoint state"] = saved["state"].keys() == loaded["state"].keys() and all(
        torch.equal(v, loaded["state"][k][key])
        for k, s in saved["state"].items()
        for key, v in s.items()
    )
    out["checkpoint classes"] = [g["optimizer_class"] for g in loaded["param_groups"]]
    out["checkpoint model"] = exact(model, other_model)
    return out


def test_muon_with_adamw_schedules_clipping_and_sharded_checkpoints(tmp_path: Any) -> None:
    for got in run_ranks(_schedules_clipping_checkpoints, 2, str(tmp_path / "ck"), timeout_s=300):
        assert got["lrs"] == got["plain lrs"] and got["lrs"][0] < 0.02, got
        # n squares summed in any two orders differ by at most 2 (n - 1) u of their sum (u:
        # fp32's unit roundoff), so the norms by (n - 1) u relatively, plus a few roundings
        # (the squares, the square roots, the per-piece norms)
        bound = (got["elements"] + 8) * torch.finfo(torch.float32).eps / 2
        assert max(got["norm errors"]) <= bound, got
        # bitwise by construction: both sides clip with our total (core/grad_norm.clip_ is torch's
        # arithmetic) the same two-rank averages (a sum of two, either order), and run the same
        # kernels on whole tensors; the bound is kept
        assert got["max diff"] <= 1e-6, got
        assert got["checkpoint state"] and got["checkpoint model"], got
        assert got["checkpoint classes"] == ["torch.optim.Muon", "torch.optim.AdamW"]


def test_muon_with_adamw_two_ranks() -> None:
    results = run_ranks(_worker, 2, timeout_s=300)
    for got in results:
        for partition in ("flat", "sorted_greedy"):
            assert got[f"{partition} parity"], partition
            assert got[f"{partition} muon owned whole"], partition
        assert "parameter group 1 (torch.optim.Muon): Muon only supports 2D" in got["1-D in Muon"]
        assert "takes no hyperparameter 'betas'" in got["unknown hyperparameter"]
        assert "torch.optim.Muon" in got["unknown hyperparameter"]
        for partition in ("flat", "sorted_greedy"):
            assert got[f"{partition} fp32 main parity"], partition
            assert got[f"{partition} fp32 main state"] == ["torch.float32"], got
        for partition in ("flat", "sorted_greedy"):
            assert got[f"{partition} reduce_scatter_hook parity"], partition
    first = results[0]
    for partition in ("flat", "sorted_greedy"):
        assert first[f"{partition} classes"] == ["torch.optim.Muon", "torch.optim.AdamW"]
        assert first[f"{partition} state"], partition
        assert (
            "parameter group 0 was saved for torch.optim.AdamW" in first[f"{partition} wrong class"]
        )
        assert first[f"{partition} reloaded"], partition


def _four_ranks(rank: int, world_size: int) -> dict[str, bool]:
    """At 4 ranks, 1-D and on a 2 x 2 mesh (state sharded in pairs, replicated across them),
    6 steps each: every rank averages the same gradients, so each is bitwise equal to the
    plain optimizers, whatever the order in which gloo adds."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out: dict[str, bool] = {}
    cases: list[tuple[str, str, dict[str, Any]]] = [
        ("1-D", "flat", {}),
        ("2x2 mesh", "flat", {"device_mesh": mesh}),
        ("2x2 mesh", "sorted_greedy", {"device_mesh": mesh}),
    ]
    for layout, partition, options in cases:
        model, ref_model = TinyGPT(), TinyGPT()
        zero = recipe(model, partition, **options)
        matrices, rest = split(ref_model)
        plain = [
            torch.optim.Muon(matrices, lr=0.02),
            torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.1, fused=True),
        ]
        train_both([(model, zero), (ref_model, plain)], rank, world_size, 6, backward)
        out[f"{layout} {partition}"] = exact(model, ref_model)
    return out


def test_muon_with_adamw_at_four_ranks_and_on_a_mesh() -> None:
    for got in run_ranks(_four_ranks, 4, timeout_s=300):
        assert all(got.values()), got
