"""The ``slow`` marker (tests/conftest.py): on each test that starts processes, on no other."""

from __future__ import annotations

import importlib
import multiprocessing
import subprocess
import sys

import pytest

from tests.conftest import process_starts, starts_processes


def roots(*names: str) -> list[object]:
    """``module.name`` of the tests package, each: a test and the fixtures it requests. Named
    as text, so that this module's own tests do not reach what they look at."""
    out: list[object] = []
    for name in names:
        module, attr = name.split(".")
        out.append(getattr(importlib.import_module(f"tests.{module}"), attr))
    return out


@pytest.mark.parametrize(
    "names",
    [
        ["test_optimizer.test_constructor_rejects_bad_params_before_any_collective"],
        ["test_sharded.test_simulated_flat_ranks_together_equal_the_unsharded_update_bitwise"],
        ["test_compiled.test_policy_compiles_only_where_the_table_says"],
    ],
    ids=["optimizer", "sharded", "compiled"],
)
def test_a_pure_test_beside_multi_process_ones_is_not_slow(names: list[str]) -> None:
    assert not starts_processes(roots(*names))


@pytest.mark.parametrize(
    "names",
    [
        # run_ranks in its own text
        ["test_mesh.test_mesh_arguments_are_checked"],
        # main(["train", ...]) in src reaches launch.run_ranks
        ["test_cli.test_train_a_bf16_model_matches_its_reference_bitwise_at_2_ranks"],
        # torch.multiprocessing.start_processes in another test module (tests/exit_stress.py)
        ["test_teardown.test_two_ranks_started_and_stopped_many_times_never_abort"],
        # a fixture that compiles (inductor runs the C++ compiler)
        ["test_compiled.test_adam_step_counts_are_bitwise_equal", "test_compiled.adam_runs"],
    ],
    ids=["own text", "through src", "another test module", "fixture compiles"],
)
def test_a_test_that_starts_processes_is_slow(names: list[str]) -> None:
    assert starts_processes(roots(*names))


def test_the_hook_marks_this_pure_test_fast(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("slow") is None


def test_process_starts_records_subprocesses_and_multiprocessing_and_nothing_else() -> None:
    with process_starts() as started:
        sum(range(10))
    assert started == []
    with process_starts() as started:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert len(started) == 1 and started[0].startswith("subprocess.Popen"), started
    with process_starts() as started:
        child = multiprocessing.get_context("fork").Process(target=sum, args=([],))
        child.start()
        child.join()
    assert any(s.startswith("multiprocessing") for s in started), started
