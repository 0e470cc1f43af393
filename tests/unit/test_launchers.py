"""SLURM's and Kubeflow's variables read as ``app/cluster.py`` reads them: host lists expanded as
``scontrol`` does, torchrun's variables first; the ranks' roll call (``app/rendezvous.py``), in
threads (processes that train: ``tests/dist/test_launchers.py``)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from zero_functional.app.cluster import (
    ClusterError,
    ClusterRank,
    cluster_rank,
    expand_hostlist,
    slurm_port,
)
from zero_functional.app.launch import free_port
from zero_functional.app.rendezvous import JoinError, rendezvous


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


def _meet(ranks: list[int], world_size: int, timeout_s: float) -> list[object]:
    """What ``rendezvous`` returns or raises on each of ``ranks``, each in its own thread."""
    port = free_port()

    def one(rank: int) -> object:
        try:
            return rendezvous(
                ClusterRank(rank, world_size, rank, "127.0.0.1", port, "SLURM"), timeout_s, {}
            )
        except JoinError as e:
            return e

    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(one, ranks))


def test_ranks_that_came_name_the_one_that_did_not_within_the_timeout() -> None:
    for e in _meet([0, 1], world_size=3, timeout_s=0.5):  # rank 2 never starts
        assert isinstance(e, JoinError) and e.missing == (2,)
        assert str(e).startswith("rank 2 (SLURM task 2) did not join the rendezvous at 127.0.0.1:")
    [e] = _meet([2], world_size=3, timeout_s=0.2)  # rank 0, which hosts it, never starts
    assert isinstance(e, JoinError) and e.missing == (0,)
    opened = (
        r"rank 0 \(SLURM task 0\), which hosts the rendezvous, did not open it at 127\.0\.0\.1:"
    )
    assert re.fullmatch(opened + r"\d+ within 0\.2 s", str(e)), e


def test_ranks_that_all_come_get_the_store_and_torchruns_agent_holds_its_own() -> None:
    stores = _meet([0, 1, 2], world_size=3, timeout_s=30.0)
    assert not any(isinstance(s, JoinError) for s in stores) and None not in stores
    where = ClusterRank(0, 2, 0, "127.0.0.1", free_port(), "torchrun")
    assert rendezvous(where, 1.0, {"TORCHELASTIC_USE_AGENT_STORE": "True"}) is None
