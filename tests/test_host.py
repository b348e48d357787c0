"""grpo_jax/host.py: with ``cpu_buffers=retain`` a program's scratch memory is reused from one
call to the next instead of being page-faulted in anew (the reason the setting exists), and
the setting is refused, or reported as not applied, once jax's backends run.

The fault counts come from fresh subprocesses (the settings are process-wide and must precede
jax's backend): one jitted program with a 128 MiB temp buffer, called five times after two
warm-up calls, its minor page faults per call read from getrusage. The fewest faults of the
five calls is compared: on a loaded machine (the suite's other worker) an occasional retained
call was seen to fault its buffer in again, while an idle one shows none after the first."""

import json
import platform
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from ml_collections import config_dict

from grpo_jax import host

TEMP_PAGES = 128 * 2**20 // 4096  # the program's temp buffer in 4 KiB pages

SCRIPT = """
import json, resource, sys
from grpo_jax import host
done = host.retain_cpu_buffers() if sys.argv[1] == "retain" else []
import jax, jax.numpy as jnp
x = jnp.full((4096, 4096), 0.5)
f = jax.jit(lambda x: (jnp.sin(x) + jnp.sin(x).T).sum()).lower(x).compile()
temp = f.memory_analysis().temp_size_in_bytes
for _ in range(2):
    f(x).block_until_ready()
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"done": done, "temp": temp, "faults": min(faults), "all": faults}))
"""


def faults_per_call(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def thp_always() -> bool:
    """Transparent huge pages for every mapping: the default then faults 2 MiB at a time."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.is_file() and "[always]" in path.read_text()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the malloc settings are glibc's")
def test_retain_reuses_the_scratch_memory_that_release_faults_in_every_call():
    retain, release = faults_per_call("retain"), faults_per_call("release")
    assert retain["temp"] == release["temp"] == 128 * 2**20
    assert retain["done"] == [
        "jax_cpu_enable_async_dispatch=False",
        "glibc mallopt M_MMAP_MAX=0 M_TRIM_THRESHOLD=2147483647",
    ]
    # retain: the pages of the last call are reused (observed 0 or 1 faults per call)
    assert retain["faults"] < 0.01 * TEMP_PAGES, retain
    if not thp_always():  # release: every 4 KiB page of the temp buffer again (observed 32,770)
        assert release["faults"] > 0.9 * TEMP_PAGES, release


def test_retain_is_refused_once_the_backends_run():
    jax.devices()  # this process's backends are up
    with pytest.raises(RuntimeError, match="before jax starts its backends"):
        host.retain_cpu_buffers()


def test_configure_reports_a_setting_it_can_no_longer_apply(caplog):
    jax.devices()
    config = config_dict.ConfigDict({"cpu_buffers": "retain"})
    dispatch = jax.config.values["jax_cpu_enable_async_dispatch"]
    with caplog.at_level("WARNING"):
        assert host.configure(config) == []
    assert any("cpu_buffers=retain not applied" in r.getMessage() for r in caplog.records)
    assert jax.config.values["jax_cpu_enable_async_dispatch"] == dispatch  # nothing changed
    caplog.clear()
    host.configure(config_dict.ConfigDict({"cpu_buffers": "release"}))
    assert not caplog.records
    with pytest.raises(ValueError, match="cpu_buffers='keep' is unknown; choose from retain"):
        host.configure(config_dict.ConfigDict({"cpu_buffers": "keep"}))
