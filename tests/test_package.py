"""The package as a user installs it, not as the checkout runs it: a wheel built from this tree,
installed into a fresh venv, trains from a directory outside the checkout through the
``grpo-jax`` console script, loading its config by name from the package (grpo_jax/configs/).

The venv gets the wheel only; its dependencies (jax, flax, ...) come from this interpreter's
site-packages through a path file, so the test needs no network and no second copy of jax. The
path file adds those directories without running their .pth files, so the editable install of
the checkout is not visible in the venv (the test asserts where grpo_jax was imported from).
"""

import os
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import grpo_jax

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*cmd, "-w", str(out), str(ROOT)], check=True, capture_output=True)
    (path,) = out.glob("grpo_jax-*.whl")
    return path


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel):
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
    subprocess.run([*pip, "--no-deps", "--no-index", str(wheel)], check=True)
    purelib = subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    deps = {*site.getsitepackages(), sysconfig.get_paths()["purelib"]}
    Path(purelib, "_grpo_jax_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    return root


def test_wheel_holds_configs_version_and_marker(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for config in ("shakespeare", "toy_bandit", "arithmetic", "fill_in"):
        assert f"grpo_jax/configs/{config}.py" in names
    assert "grpo_jax/py.typed" in names
    assert wheel.name.startswith(f"grpo_jax-{grpo_jax.__version__}-")
    assert not any(n.startswith(("tests/", "configs/", "experiments/")) for n in names)


def test_installed_wheel_trains_outside_the_checkout(venv, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    python = venv / "bin" / "python"
    where = subprocess.check_output(
        [str(python), "-c", "import grpo_jax; print(grpo_jax.__file__)"], cwd=tmp_path, text=True
    )
    assert Path(where).resolve().is_relative_to(venv.resolve()), where
    run = [str(venv / "bin" / "grpo-jax"), "--config=toy_bandit:tiny", "--workdir=run"]
    steps = ["--config.train.num_steps=2", "--config.train.log_every=1"]
    proc = subprocess.run([*run, *steps], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert any('"step": 2' in row and '"loss"' in row for row in rows), rows
    assert (tmp_path / "run" / "config.json").is_file()
