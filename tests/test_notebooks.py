"""Executes every notebook top to bottom on CPU in small mode (GRPO_JAX_NOTEBOOK_SMALL=1)."""

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_all_notebooks_are_collected():
    names = {p.name for p in NOTEBOOKS}
    assert {"quickstart.ipynb", "exhaustive_vs_sampled.ipynb", "toy_grpo.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, shakespeare_path, monkeypatch):
    monkeypatch.setenv("GRPO_JAX_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("GRPO_JAX_DATA", str(shakespeare_path))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    book = nbformat.read(path, as_version=4)
    source = "\n".join(c.source for c in book.cells if c.cell_type == "code")
    assert "def " not in source and "class " not in source  # notebooks define none of it
    client = nbclient.NotebookClient(
        book, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # raises CellExecutionError with the failing cell's traceback
    errors = [
        o
        for c in book.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors
    assert os.environ.get("GRPO_JAX_NOTEBOOK_SMALL") == "1"
