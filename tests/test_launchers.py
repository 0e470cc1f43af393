"""``train`` under SLURM (srun, one task per process) and a Kubeflow PyTorchJob: the rank, world
size and rendezvous come from their variables (app/cluster.py); processes on 127.0.0.1 given
those variables train to the end."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from zero_functional.app.cluster import (
    ClusterError,
    cluster_rank,
    expand_hostlist,
    slurm_port,
)
from zero_functional.app.launch import free_port

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
ARGS = ["train", "--epochs", "1", "--hidden", "16", "--batch-size", "96", "--no-progress"]


def test_host_lists_expand_as_scontrol_does() -> None:
    assert expand_hostlist("node[01-04,07]") == ["node01", "node02", "node03", "node04", "node07"]
    assert expand_hostlist("a1,b[2-3]") == ["a1", "b2", "b3"]
    assert expand_hostlist("n[9-11]") == ["n9", "n10", "n11"]
    assert expand_hostlist("gpu[098-100]-ib") == ["gpu098-ib", "gpu099-ib", "gpu100-ib"]
    for bad in ("node[1-", "node]1[", "a,,b", "node[3-1]", "node[a-b]"):
        with pytest.raises(ClusterError, match="host list"):
            expand_hostlist(bad)


def test_torchruns_variables_win_over_slurms_and_a_pytorchjob_has_local_rank_0() -> None:
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0"}
    slurm |= {"SLURM_JOB_NODELIST": "c[1-2]", "SLURM_JOB_ID": "77"}
    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "c1"}
    r = cluster_rank({**slurm, **torchrun, "MASTER_PORT": "1234"})  # srun + torchrun
    assert r is not None and (r.rank, r.world_size, r.local_rank, r.source) == (5, 8, 1, "torchrun")
    r = cluster_rank(slurm)
    assert r is not None and (r.rank, r.world_size, r.local_rank) == (1, 2, 1)
    assert (r.master_addr, r.master_port) == ("c1", slurm_port(77))
    r = cluster_rank({**slurm, "MASTER_ADDR": "head", "MASTER_PORT": "4321"})
    assert r is not None and (r.master_addr, r.master_port) == ("head", 4321)
    # a batch script without srun (no step): train spawns its own ranks
    assert cluster_rank({k: v for k, v in slurm.items() if k != "SLURM_STEP_ID"}) is None
    job = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    r = cluster_rank(job)
    assert r is not None and (r.local_rank, r.source) == (0, "RANK/WORLD_SIZE (a PyTorchJob)")
    with pytest.raises(ClusterError, match=r"MASTER_PORT"):
        cluster_rank({k: v for k, v in job.items() if k != "MASTER_PORT"})
    with pytest.raises(ClusterError, match=r"SLURM: SLURM_PROCID='x' is not an integer"):
        cluster_rank({**slurm, "SLURM_PROCID": "x"})
    with pytest.raises(ClusterError, match="rank 3 and local rank 0 must be from 0 to"):
        cluster_rank({**job, "RANK": "3"})


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _run_ranks(
    envs: list[dict[str, str]], tmp_path: Path
) -> list[subprocess.CompletedProcess[str]]:
    """``python -m zero_functional train`` once per rank, each with its own variables."""
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "zero_functional", *ARGS, "--checkpoint", str(tmp_path / "ck")],
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in envs
    ]
    done = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def _trained_to_the_end(done: list[subprocess.CompletedProcess[str]]) -> None:
    assert [p.returncode for p in done] == [0, 0], [p.stderr for p in done]
    out = done[0].stdout
    assert "2 rank(s)" in out and "(seed 0): bitwise equal\n" in out, out
    assert done[1].stdout == ""  # the summary is rank 0's


def test_srun_tasks_one_per_process_train_to_the_end(tmp_path: Path) -> None:
    # MASTER_ADDR from the host list, MASTER_PORT from the job id: a job id whose port is free
    job_id = next(j for j in range(1, 2000) if _free(slurm_port(j)))
    envs = [
        {"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r)}
        | {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": str(job_id)}
        | {"SLURM_JOB_NODELIST": "127.0.0.1,node[02-03]"}
        for r in range(2)
    ]
    _trained_to_the_end(_run_ranks(envs, tmp_path))


def test_pytorchjob_pods_without_local_rank_train_to_the_end(tmp_path: Path) -> None:
    port = str(free_port())
    envs = [
        {"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        for r in range(2)
    ]
    _trained_to_the_end(_run_ranks(envs, tmp_path))
