"""Every notebook in notebooks/ runs top to bottom (small sizes, 120 s each)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom_and_is_stored_without_outputs(
    path: Path, tmp_path: Path
) -> None:
    nbformat = pytest.importorskip(
        "nbformat", reason="notebook tests need nbformat (the test extra)"
    )
    nbclient = pytest.importorskip(
        "nbclient", reason="notebook tests need nbclient (the test extra)"
    )
    nb = nbformat.read(path, as_version=4)
    assert all(
        not c.get("outputs") and not c.get("execution_count")
        for c in nb.cells
        if c.cell_type == "code"
    ), f"{path.name} is committed with outputs; strip them (jupyter nbconvert --clear-output)"
    # run in a scratch directory so figures a notebook saves do not land in the checkout
    nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
