"""Meshes, shardings, the member shard_map and seeds in parallel.

The multi-device checks run in a subprocess with 8 fake CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before jax starts);
pytest's own process keeps its single device for the mesh-free unit tests and the vmapped
seeds. The entry point on several meshes, checkpoints across meshes and several processes
are tests/test_multihost.py's.
"""

import json
import os
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from ml_collections import config_dict

from grpo_jax import sharding
from grpo_jax.config_blocks import load_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _sharding_check import param_diff, run_python

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "_sharding_check.py"
TOL = 1e-5
pytestmark = pytest.mark.usefixtures("fast_compiles")  # in-process tests; 8 devices: subprocesses


# ------------------------------------------------------------------- mesh-free units


def mesh_cfg(data=-1, vocab=1):
    return config_dict.ConfigDict({"data": data, "member": vocab, "shard_params": False})


def test_mesh_shape():
    assert sharding.mesh_shape(mesh_cfg(), 8) == (8, 1)
    assert sharding.mesh_shape(mesh_cfg(2, 4), 8) == (2, 4)
    assert sharding.mesh_shape(mesh_cfg(-1, 4), 8) == (2, 4)
    assert sharding.mesh_shape(mesh_cfg(2, -1), 8) == (2, 4)
    assert sharding.mesh_shape(mesh_cfg(1, 1), 8) == (1, 1)
    assert sharding.mesh_shape(None, 4) == (4, 1)
    for bad in (mesh_cfg(3, 1), mesh_cfg(-1, 3), mesh_cfg(4, 4), mesh_cfg(0, 1), mesh_cfg(-1, -1)):
        with pytest.raises(ValueError) as err:
            sharding.mesh_shape(bad, 8)
        assert "\n" not in str(err.value) and "mesh." in str(err.value)


def test_single_device_mesh_and_batch_check():
    assert jax.config.jax_threefry_partitionable
    mesh = sharding.make_mesh(mesh_cfg())
    assert dict(mesh.shape) == {"data": jax.device_count(), "member": 1}
    sharding.check_batch(8, mesh)
    fake = type("M", (), {"shape": {"data": 4, "member": 2}})()
    with pytest.raises(ValueError, match=r"train.batch_size=6 is not divisible by .* \(4 dev"):
        sharding.check_batch(6, fake)


def test_per_device_work_counts_the_rollouts_each_device_runs():
    """Adaptive groups at B = 4, V = 65, G = 4: a sampled part [4, 4] and the forced part, one
    chosen prompt padded to one row per data device (groups.make_collect): [d, 65]. The data
    axis splits rows, the member axis members, each padded to its axis. Before, on (data=2)
    the count was the one-device 4 x 20.25 split in two (40.5), not 2 x 4 + 65."""
    mesh = lambda d, v: type("M", (), {"shape": {"data": d, "member": v}})()
    work = lambda d, v: sharding.per_device_work(mesh(d, v), 4, [(4, 4), (d, 65)])
    assert work(1, 1)["rollouts_per_device"] == 4 * 4 + 65
    assert work(1, 1)["members_per_prompt"] == 4 + 65 / 4
    assert work(2, 1)["rollouts_per_device"] == 2 * 4 + 65
    assert work(2, 1)["members_per_prompt"] == 4 + 2 * 65 / 4  # the padding row's too
    assert work(2, 2)["rollouts_per_device"] == 2 * 2 + 33  # 65 members: 33 per device
    assert work(1, 2)["rollouts_per_device"] == 4 * 2 + 33
    got = work(2, 2)
    assert got["prompts_per_device"] == 2 and got["members_per_prompt_per_device"] == 37 / 2
    # sampled G = 4 on (member=3): 2 members per device
    got = sharding.per_device_work(mesh(1, 3), 4, [(4, 4)])
    assert got["members_per_prompt_per_device"] == 2 and got["rollouts_per_device"] == 8


def test_fsdp_spec():
    P = jax.sharding.PartitionSpec
    assert sharding.fsdp_spec((32, 96), 4) == P(None, "data")  # largest divisible axis
    assert sharding.fsdp_spec((65, 32), 4) == P(None, "data")  # 65 does not divide
    assert sharding.fsdp_spec((65, 33), 4) == P()  # nothing divides: replicated
    assert sharding.fsdp_spec((128,), 4) == P()  # 1-D leaves stay replicated
    assert sharding.fsdp_spec((32, 96), 1) == P()


# ------------------------------------------------------------ 8 fake CPU devices


def _env(tmp_cache):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        # CPU codegen effort only: every run of a comparison uses the same flags
        " --xla_backend_optimization_level=0"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_cache)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def env8(tmp_path_factory, shakespeare_path):
    env = _env(tmp_path_factory.mktemp("xla_cache"))
    env["GRPO_JAX_DATA"] = str(shakespeare_path)
    return env


@pytest.fixture(scope="module")
def equivalence(env8):
    """3 steps of sampled and exhaustive groups (batch 8) on the plain single-device path
    and on the meshes (data=8), (data=2, member=4), (member=8)."""
    proc = run_python([CHECK, "equivalence", "sampled", "exhaustive"], env8)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["sampled", "exhaustive"])
def test_meshes_give_the_same_step(equivalence, mode):
    res = equivalence[mode]
    assert res["num_devices"] == 8
    assert set(res["meshes"]) == {"(8, 1, False)", "(2, 4, False)", "(1, 8, False)"}
    for name, m in res["meshes"].items():
        assert m["same_metric_keys"], name
        assert m["max_metric_diff"] < TOL, (name, m)  # loss and every scalar metric
        assert m["max_param_diff"] < TOL, (name, m)
        assert m["traces"] == 1 and m["cache_size"] == 1, (name, m)  # compiled once per mesh


@pytest.fixture(scope="module")
def few_rows(env8):
    return json.loads(run_python([CHECK, "few_rows"], env8).stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode, meshes", [("adaptive", 2), ("exhaustive", 1), ("decision_only", 1)])
def test_few_prompts_per_data_device_take_the_same_step(few_rows, mode, meshes):
    """Adaptive groups' forced sub-batch (ceil(B / 4) prompts) split unevenly over ``data``
    made GSPMD's padding rows turn the gradient into NaN (B = 4 on (data=2, member=4) and
    (4, 2)), and every step kept its old state; they were refused on 2-D meshes. The
    sub-batch is now padded to whole rows per data device (groups.make_collect).
    Exhaustive groups of one prompt per data device (B = 2 on (2, 4)) differ from one device
    under jax <= 0.7.2 (metrics by 0.084), hence the jax >= 0.8.0 pin. A decision point
    alone, "batch"-scaled, with FSDP on (2, 4): each device sums its rows' share
    (loss.decision_only), the variance's too."""
    res = few_rows[mode]
    assert len(res["meshes"]) == meshes
    for name, m in res["meshes"].items():
        assert m["same_metric_keys"] and m["max_metric_diff"] < TOL, (name, m)
        assert m["max_param_diff"] < TOL, (name, m)


@pytest.fixture(scope="module")
def fsdp_rollout(env8):
    return json.loads(run_python([CHECK, "fsdp_rollout"], env8).stdout.strip().splitlines()[-1])


def test_fsdp_params_are_gathered_once_not_at_every_decode_step(fsdp_rollout):
    """With the params sharded over data=8 (mesh.shard_params), the step equals one
    device's, and its compiled decode loop runs no collective: the engine gathers the
    rollout's params once (sharding.step_hooks' ``whole``), and the loss's map the update's
    (sharding.make_member_sum). Before, XLA partitioned each decode step's products by the
    weights' sharding: all-gathers and all-reduces of weights and activations at every step
    (8 in this loop's body; on 8 GPUs the 12 x 768 model's decode loop ran 11,049
    collectives a step)."""
    res = fsdp_rollout
    m = res["meshes"]["(8, 1, True)"]
    assert m["same_metric_keys"] and m["max_metric_diff"] < TOL, m
    assert m["max_param_diff"] < TOL and m["traces"] == 1, m
    assert res["sharded_leaves"] > 0  # the params are sharded: there is something to gather
    assert res["decode_loops"] >= 1
    assert res["loop_collectives"] == []
    # the step's all-gathers move under 4 copies of the params (the rollout's and the
    # update's gathers: 2.9 copies), and nothing is resharded all-to-all. Gathering only the
    # rollout's, XLA partitioned the update's products by the weights' sharding: 138
    # all-gathers of 17 copies, 72 all-to-alls (24 GB a step for the 12 x 768 model on a v5e-8)
    coll = res["step_collectives"]
    assert 0 < coll["all-gather"]["bytes"] < 4 * res["param_bytes"], (coll, res["param_bytes"])
    assert "all-to-all" not in coll, coll


def test_fsdp_scatters_the_gradient_onto_its_shards(fsdp_rollout):
    """With the params sharded over data=8, each update's gradient is reduce-scattered onto
    the shards: the loss's map gathers the params inside (sharding.make_member_sum), and
    its transpose is a reduce-scatter. What is still all-reduced (the 1-D leaves, which
    stay replicated) moves 0.15 of a copy of the params per update. Before, the loss took
    the params gathered outside and XLA all-reduced the whole gradient: 2.25 copies per
    update, and no reduce-scatter."""
    res = fsdp_rollout
    coll, copies = res["step_collectives"], res["param_bytes"] * res["updates"]
    assert coll["reduce-scatter"]["count"] > 0, coll
    assert coll["all-reduce"]["bytes"] < 0.25 * copies, (coll, copies)


def test_each_update_sums_its_gradient_over_the_devices_once(env8):
    """On (data=8) and (data=2 x member=4) a sampled or exhaustive step's all-reduces move
    one copy of the params per update (1.00-1.01x), in one all-reduce over the 8 devices:
    a part's members' loop and their prompts' prefill (an exhaustive part's decision point
    with it) run in one shard_map over both axes (sharding.make_member_sum). Before, the
    loop's gradient was summed over ``member`` by that map's transpose and again over
    ``data`` by GSPMD, the prefill's apart: sampled 2.25x (data=8) and 3.35x (2 x 4); with
    the decision point's prefill outside the map, exhaustive 6.79x (data=8) and 2.41x
    (2 x 4)."""
    res = json.loads(run_python([CHECK, "gradient_sums"], env8).stdout.strip().splitlines()[-1])
    for mode in ("sampled", "exhaustive"):
        row = res[mode]
        copies = row["param_bytes"] * row["updates"]
        for mesh in ("8x1", "2x4"):
            moved = row[mesh]["all-reduce"]["bytes"]
            assert copies <= moved < 1.1 * copies, (mode, mesh, moved / copies, row)


def test_the_reference_splits_its_members_over_the_member_axis(env8):
    """π_ref's per-token log-probs of 8 members on (member=8) equal one device's, and each
    device computes under a quarter of them (0.17 of one device's FLOPs; the prompt's
    prefill, which every member needs, is not split). Before, the reference ran outside the
    member shard_map and GSPMD kept it whole: 0.97 of one device's FLOPs on each, and on a
    v5e-16 (data=4 x member=4) an all-gather of every member's activations."""
    res = json.loads(run_python([CHECK, "reference_split"], env8).stdout.strip().splitlines()[-1])
    assert res["shape"] == [2, 8, 32]
    assert res["max_diff"] < TOL, res
    assert res["flops"]["1x8"] < res["flops"]["1x1"] / 4, res["flops"]


@pytest.fixture(scope="module")
def split_work(env8):
    return json.loads(run_python([CHECK, "split_work"], env8).stdout.strip().splitlines()[-1])


def test_a_single_step_task_takes_the_same_step_on_every_mesh(split_work):
    for name, m in split_work["toy_bandit"]["meshes"].items():
        assert m["max_metric_diff"] < TOL and m["max_param_diff"] < TOL, (name, m)
        assert m["traces"] == 1 and m["cache_size"] == 1, (name, m)


@pytest.mark.parametrize("task, meshes", [("toy_bandit", ["8x1"]), ("shakespeare", ["8x1", "1x8"])])
def test_the_mesh_splits_the_steps_work(split_work, task, meshes):
    """On (data=8), and for the autoregressive step on (member=8), each device computes under
    a quarter of the one-device step. Before: toy_bandit's build ignored the mesh (every
    device ran the whole step), and on (member=8) GSPMD kept the loss's member loop whole, so
    the update's training forward and backward ran in full on every device
    (sharding.make_member_sum). (toy_bandit's members share one forward per prompt, which
    the member axis does not split.)"""
    flops = split_work[task]["flops"]
    assert all(flops[mesh] < flops["1x1"] / 4 for mesh in meshes), flops


@pytest.fixture(scope="module")
def supervised(env8):
    return json.loads(run_python([CHECK, "supervised"], env8).stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "name", ["shakespeare_pretrain", "arithmetic_sft", "fill_in_judge", "fill_in_pretrain"]
)
def test_supervised_steps_split_their_batch_over_data(supervised, name):
    """Pretraining, completion SFT and the fill-in judge and generator: on (data=8) the same
    3 steps as on one device, each device computing under a quarter of them. Before, their
    builds ignored the mesh and every device ran the whole batch (about the one-device
    FLOPs on each)."""
    res = supervised[name]
    m = res["meshes"]["(8, 1, False)"]
    assert m["same_metric_keys"] and m["max_metric_diff"] < TOL, m
    assert m["max_param_diff"] < TOL and m["traces"] == 1, m
    assert res["flops"]["8x1"] < res["flops"]["1x1"] / 4, res["flops"]


def test_a_supervised_batch_the_data_axis_does_not_divide_is_refused(supervised):
    refused = supervised["refused"]
    assert "pretrain.batch_size=12 is not divisible by the mesh's data axis" in refused["error"]
    assert not refused["workdir_made"]


# --------------------------------------------------------------- seeds in parallel


def test_vmapped_seeds_equal_separate_runs(shakespeare_path, monkeypatch):
    monkeypatch.setenv("GRPO_JAX_DATA", str(shakespeare_path))
    from grpo_jax import tasks as task_lib
    from grpo_jax import trainer

    config = load_config("shakespeare", "sampled,tiny")
    task = task_lib.build_task(config, "train")
    params0 = trainer.initial_params(config, task)
    step_fn, inputs = task.build(params0)
    seeds = (0, 1, 2)
    # different rng per seed, and different initial params too
    stacked = sharding.seed_states(task.make_state, params0, seeds, init_params=task.init_params)
    step_fn = step_fn.fused  # engine.Step: one program (the task has no Python reward)
    multi = jax.jit(sharding.make_multi_seed_step(step_fn), donate_argnums=0)
    single = jax.jit(step_fn)
    separate = [sharding.unstack_state(stacked, i) for i in range(len(seeds))]
    metrics_multi, metrics_sep = [], [[] for _ in seeds]
    for _ in range(2):
        stacked, m = multi(stacked, inputs)
        metrics_multi.append(jax.device_get(m))
        for i in range(len(seeds)):
            separate[i], mi = single(separate[i], inputs)
            metrics_sep[i].append(jax.device_get(mi))
    for i in range(len(seeds)):
        # params and optimizer moments; attention key biases apart (see param_diff)
        worst, _ = param_diff(jax.device_get(sharding.unstack_state(stacked, i)), separate[i])
        assert worst < TOL, (i, worst)
        for t in range(2):
            for k, v in metrics_sep[i][t].items():
                np.testing.assert_allclose(metrics_multi[t][k][i], v, atol=TOL, err_msg=k)
    # the seeds really differ
    assert metrics_multi[0]["loss"][0] != metrics_multi[0]["loss"][1]
