"""Executes every notebook top to bottom on CPU in small mode (GRPO_JAX_NOTEBOOK_SMALL=1) and
checks its figures and that its committed outputs come from the current code.

The committed outputs are written by this file's own executor:

    GRPO_JAX_DATA=... python tests/test_notebooks.py --write [name ...]

so the test and the committed run execute the notebooks the same way. Outputs are compared by
shape (kinds and mime types of each code cell's outputs), never by pixels or numbers: those
change with the machine and the JAX version, while a cell that gains, loses or changes a
figure, a print or a result changes the shape.
"""

import datetime
import os
import sys
from pathlib import Path

import pytest
from conftest import compilation_cache_dir

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
PLOT_TAG = "plot"  # a code cell that draws a figure
NOTE_TAG = "outputs-note"  # the markdown cell that says where the committed outputs come from


def tagged(book, tag):
    return [c for c in book.cells if tag in c.get("metadata", {}).get("tags", [])]


def small_cpu_env(data_path):
    """The environment of a small-mode CPU run (the kernel inherits os.environ)."""
    return {
        "GRPO_JAX_NOTEBOOK_SMALL": "1",
        "GRPO_JAX_DATA": str(data_path),
        "JAX_PLATFORMS": "cpu",
    }


def execute(path, env, timeout=300):
    """A copy of the notebook at `path`, executed top to bottom under `env` (added to
    os.environ for the kernel's lifetime). Raises CellExecutionError on a failing cell."""
    book = nbformat.read(path, as_version=4)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        # The kernel draws with Jupyter's inline backend, as on Colab, whatever the caller's
        # shell (or an in-process CLI run, which defaults MPLBACKEND to Agg) chose.
        mp.delenv("MPLBACKEND", raising=False)
        client = nbclient.NotebookClient(
            book,
            timeout=timeout,
            kernel_name="python3",
            record_timing=False,  # no per-cell timestamps in the committed file
            resources={"metadata": {"path": str(path.parent)}},
        )
        client.execute()
    return book


def output_shape(cell):
    """What a code cell showed, without the values: its rich outputs in order as (output
    type, mime types), and whether it printed. stdout counts once however many chunks the
    kernel sent it in (that depends on timing); stderr, where warnings go, not at all: a
    threshold warning (diagnostics' KL bound) may come and go with a machine's rounding."""
    rich, printed = [], False
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            printed = printed or out["name"] == "stdout"
        elif out["output_type"] == "error":
            rich.append(("error", out["ename"]))
        else:
            rich.append((out["output_type"], tuple(sorted(out.get("data", {})))))
    return {"rich": rich, "printed": printed}


def shapes(book):
    return [output_shape(c) for c in book.cells if c.cell_type == "code"]


# ---------------------------------------------------------------- tests


def test_all_notebooks_are_collected():
    names = {p.name for p in NOTEBOOKS}
    assert {"quickstart.ipynb", "exhaustive_vs_sampled.ipynb", "toy_grpo.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_defines_nothing(path):
    committed = nbformat.read(path, as_version=4)
    source = "\n".join(c.source for c in committed.cells if c.cell_type == "code")
    assert "def " not in source and "class " not in source  # the library holds the code


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_badge_and_note_on_top(path):
    committed = nbformat.read(path, as_version=4)
    top = committed.cells[0].source
    assert "colab.research.google.com/github/" in top and f"notebooks/{path.name})" in top
    note = tagged(committed, NOTE_TAG)
    assert len(note) == 1 and "GRPO_JAX_NOTEBOOK_SMALL=1" in note[0].source


def fast_compile_env(cache_dir):
    """Cheap XLA compiles and a persistent cache shared by the notebooks (quickstart and
    exhaustive_vs_sampled share tiny exhaustive programs) and the conftest `fast_compiles`
    tests: about a third less CPU. Test-only: the committed outputs come from default
    compiles, and the checks below compare no numbers."""
    return {
        "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


@pytest.fixture(scope="module", params=NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def notebook(request, shakespeare_path, tmp_path_factory):
    """(path, committed notebook, freshly executed notebook): each notebook runs once per
    session, shared by the tests below."""
    path = request.param
    committed = nbformat.read(path, as_version=4)
    cache_dir = compilation_cache_dir(tmp_path_factory)
    env = {**small_cpu_env(shakespeare_path), **fast_compile_env(cache_dir)}
    return path, committed, execute(path, env)


def test_every_plot_cell_shows_an_image(notebook):
    _, _, executed = notebook
    plot_cells = tagged(executed, PLOT_TAG)
    assert plot_cells, f"no code cell is tagged {PLOT_TAG!r}"
    for cell in plot_cells:
        mimes = [m for o in cell.outputs for m in o.get("data", {})]
        assert "image/png" in mimes, f"plot cell shows no image/png:\n{cell.source}"


def test_committed_outputs_are_from_current_code(notebook):
    path, committed, executed = notebook
    fix = f"re-run `python tests/test_notebooks.py --write {path.stem}` and commit"
    assert shapes(committed) == shapes(executed), f"{path.name}: stale outputs: {fix}"
    errors = [o for c in executed.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    for cell in tagged(committed, PLOT_TAG):  # the committed figures are really there
        assert any("image/png" in o.get("data", {}) for o in cell.outputs), fix


# ---------------------------------------------------------------- writing the outputs


def note_text():
    import jax

    day = datetime.date.today().isoformat()
    return (
        f"**The outputs below are from a real run in small mode** (`GRPO_JAX_NOTEBOOK_SMALL=1`: "
        f"seconds-long runs that show the plumbing, not results) **on CPU**, {day}, "
        f"jax {jax.__version__}. Unset `GRPO_JAX_NOTEBOOK_SMALL` (the default on Colab) for "
        "the full-size runs; the results of those are in `experiments/results/`."
    )


def write(path, data_path):
    """Executes `path` in small mode on CPU and writes it back with its outputs and a note
    saying so (tests/test_notebooks.py then holds every commit to those outputs)."""
    book = execute(path, small_cpu_env(data_path))
    for cell in tagged(book, NOTE_TAG):
        cell.source = note_text()
    for cell in book.cells:
        cell.get("metadata", {}).pop("execution", None)
    book.metadata.pop("widgets", None)
    nbformat.validate(book)
    nbformat.write(book, path)
    print(f"wrote {path}: {len(tagged(book, PLOT_TAG))} plot cells")


def main(argv):
    if "--write" not in argv:
        sys.exit("usage: GRPO_JAX_DATA=FILE python tests/test_notebooks.py --write [name ...]")
    names = [a for a in argv if not a.startswith("-")]
    data_path = os.environ.get("GRPO_JAX_DATA") or sys.exit("set GRPO_JAX_DATA to the corpus")
    for path in NOTEBOOKS:
        if not names or path.stem in names:
            write(path, data_path)


if __name__ == "__main__":
    main(sys.argv[1:])
