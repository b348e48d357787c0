"""Multi-device checks for tests/test_sharding.py and tests/test_multihost.py, run in a
subprocess with 8 fake CPU devices.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 GRPO_JAX_DATA=... \
      python tests/_sharding_check.py equivalence sampled

Prints one JSON object as its last line. The 8 devices must be requested before jax
initialises its backend, hence a separate process (pytest's own process keeps 1 device).
"""

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_jax import sharding, trainer
from grpo_jax import tasks as task_lib
from grpo_jax.config_blocks import load_config

ROOT = Path(__file__).resolve().parents[1]
# (data, member, shard_params); None = the plain single-device path (no mesh at all)
MESHES = (None, (8, 1, False), (2, 4, False), (1, 8, False))


def run_python(args, env, timeout=600):
    """``python ARGS`` from the repository root; asserts it succeeded (the tests' runner)."""
    proc = subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def tiny_config(mode: str, **overrides):
    fixed = {"train.batch_size": 8, "logging.tensorboard": False, "eval.num_windows": 8}
    return load_config("shakespeare", f"{mode},tiny", **{**fixed, **overrides})


def _mesh_cfg(data, vocab):
    from ml_collections import config_dict

    return config_dict.ConfigDict({"data": data, "member": vocab, "shard_params": False})


def run_mesh(config, task, params0, spec, steps):
    """`steps` jitted steps on one mesh; returns (metrics per step, final params, traces)."""
    host_params = jax.tree.map(np.array, params0)  # fresh buffers: the state is donated
    traces = [0]

    def count(fn):
        def wrapped(*a):
            traces[0] += 1
            return fn(*a)

        return wrapped

    if spec is None:
        step_fn, inputs = task.build(host_params)
        state = task.make_state(jax.tree.map(jax.numpy.asarray, host_params))
        jstep = jax.jit(count(getattr(step_fn, "fused", step_fn)), donate_argnums=0)
    else:
        data, vocab, fsdp = spec
        mesh = sharding.make_mesh(_mesh_cfg(data, vocab))
        trainer.check_task_batch(config, task, mesh)
        config.mesh.shard_params = fsdp  # the task's build reads it, as in a run
        step_fn, inputs = task.build(host_params, mesh)
        state = task.make_state(host_params)
        jstep, state, inputs, _ = sharding.jit_step(step_fn, mesh, state, inputs, fsdp, count)
    ms = []
    for _ in range(steps):
        state, m = jstep(state, inputs)
        ms.append({k: float(v) for k, v in jax.device_get(m).items() if np.ndim(v) == 0})
    params = jax.tree.map(np.asarray, jax.device_get(state.params))
    return ms, params, traces[0], jstep._cache_size()


def param_diff(a, b):
    """Max |a - b| over the parameters, and separately over the attention key biases.

    A key bias adds q.b_k to every score of a query, which softmax ignores: its gradient
    is exactly 0 in exact arithmetic and float rounding noise (~1e-10) in practice, which
    Adam normalises into lr-sized steps of arbitrary sign. Those steps differ with the
    summation order (hence with the mesh) and leave the model's function unchanged, so
    they are reported apart and not held to the tolerance."""
    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    worst, key_bias = 0.0, 0.0
    for (path, x), y in zip(flat_a, jax.tree.leaves(b), strict=True):
        d = np.abs(np.asarray(x) - np.asarray(y))
        name = jax.tree_util.keystr(path)
        if name.endswith("['key']['bias']"):  # flax's attention (the fill-in encoder)
            key_bias = max(key_bias, float(d.max()))
            continue
        if name.endswith("['qkv']['bias']"):  # model.py's fused projection: q, k, v
            third = d.shape[-1] // 3
            key_bias = max(key_bias, float(d[third : 2 * third].max()))
            d = np.concatenate([d[:third], d[2 * third :]])
        worst = max(worst, float(d.max()))
    return worst, key_bias


def _gap(a: float, b: float) -> float:
    """|a - b|, inf where one is NaN (Python's max would skip a NaN), 0 where both are."""
    if np.isnan(a) or np.isnan(b):
        return 0.0 if np.isnan(a) and np.isnan(b) else float("inf")
    return abs(a - b)


def equivalence(mode: str, steps: int = 3, config=None, run_mode="train", meshes=MESHES[1:]):
    config = config or tiny_config(mode)
    task = task_lib.build_task(config, run_mode)
    params0 = trainer.initial_params(config, task)
    base_m, base_p, _, _ = run_mesh(config, task, params0, None, steps)
    out = {"mode": mode, "num_devices": jax.device_count(), "meshes": {}}
    for spec in meshes:
        ms, ps, traces, cache = run_mesh(config, task, params0, spec, steps)
        dm = max(_gap(a[k], b[k]) for a, b in zip(ms, base_m, strict=True) for k in b)
        same_keys = all(set(a) == set(b) for a, b in zip(ms, base_m, strict=True))
        dp, dkb = param_diff(ps, base_p)
        out["meshes"][str(spec)] = {
            "max_metric_diff": dm,
            "max_param_diff": dp,
            "key_bias_diff": dkb,
            "same_metric_keys": same_keys,
            "losses": [m["loss"] for m in ms],
            "traces": traces,
            "cache_size": cache,
        }
    out["base_losses"] = [m["loss"] for m in base_m]
    return out


def equivalence_all(*modes):
    return {m: equivalence(m) for m in (modes or ("sampled", "exhaustive"))}


def few_rows():
    """Adaptive groups of B = 4 (a forced sub-batch of one prompt) on 2-D meshes whose data
    axis does not divide that sub-batch, and exhaustive groups of B = 2 on (data=2, member=4):
    one prompt per data device; and an exhaustive decision point alone (no continuations)
    with the "batch" advantage scale, FSDP, on (2, 4): its sums over each device's rows."""
    meshes = ((2, 4, False), (4, 2, False))
    adaptive = tiny_config("adaptive", **{"train.batch_size": 4})
    exhaustive = tiny_config("exhaustive", **{"train.batch_size": 2})
    alone = {"group.train_continuations": False, "grpo.advantage_scale": "batch"}
    return {
        "adaptive": equivalence("adaptive", 3, adaptive, meshes=meshes),
        "exhaustive": equivalence("exhaustive", 3, exhaustive, meshes=meshes[:1]),
        "decision_only": equivalence(
            "exhaustive", 2, tiny_config("exhaustive", **alone), meshes=((2, 4, True),)
        ),
    }


def adaptive_sweep():
    """Not a test (minutes): adaptive groups of B = 4, 8, 12, 16 on (2,2), (4,2) and (2,4),
    the worst metric and param differences from one device per B (the CHANGELOG's figures)."""
    out = {}
    for b in (4, 8, 12, 16):
        config = tiny_config("adaptive", **{"train.batch_size": b})
        res = equivalence(
            "adaptive", 3, config, meshes=((2, 2, False), (4, 2, False), (2, 4, False))
        )
        out[b] = {k: (m["max_metric_diff"], m["max_param_diff"]) for k, m in res["meshes"].items()}
    return {"jax": jax.__version__, "by_batch": out}


def work_per_device(config, run_mode="train", shapes=((1, 1), (8, 1), (1, 8))):
    """Each device's compiled FLOPs for one step on each (data, member) mesh of ``shapes``."""
    task = task_lib.build_task(config, run_mode)
    params0 = jax.tree.map(np.array, trainer.initial_params(config, task))
    out = {}
    for data, member in shapes:
        mesh = sharding.make_mesh(_mesh_cfg(data, member))
        step, inputs = task.build(params0, mesh)
        run, state, inputs, _ = sharding.jit_step(step, mesh, task.make_state(params0), inputs)
        cost = run.lower(state, inputs).compile().cost_analysis()
        out[f"{data}x{member}"] = (cost[0] if isinstance(cost, list) else cost)["flops"]
    return out


def split_work():
    """A single-step task (toy_bandit:tiny, exhaustive) on the meshes, and the compiled work
    per device of it and of shakespeare:tiny's exhaustive step (its members' training forward
    in one piece, group.loss_chunk = vocab_chunk = 0, so a loop body is the whole work)."""
    over = {"train.batch_size": 8, "logging.tensorboard": False, "group.mode": "exhaustive"}
    bandit = load_config("toy_bandit", "tiny", **over)
    out = {"toy_bandit": equivalence("exhaustive", config=bandit)}
    out["toy_bandit"]["flops"] = work_per_device(bandit)
    whole = tiny_config("exhaustive", **{"group.loss_chunk": 0, "group.vocab_chunk": 0})
    out["shakespeare"] = {"flops": work_per_device(whole)}
    return out


def fsdp_rollout():
    """The sampled step with its params sharded over data=8 (mesh.shard_params) against one
    device (3 steps), the collectives of its compiled decode loop and of the whole step, and
    the params' bytes and the step's updates: the params are gathered whole for the rollout
    (sharding.step_hooks' ``whole``) and in the loss's map (sharding.make_member_sum), so
    the decode loop runs no collective and the step's gathers move about three copies."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import hlo_collectives
    import xla_profile

    config = tiny_config("sampled")
    out = equivalence("sampled", 3, config, meshes=((8, 1, True),))
    task = task_lib.build_task(config, "train")
    params0 = jax.tree.map(np.array, trainer.initial_params(config, task))
    mesh = sharding.make_mesh(_mesh_cfg(8, 1))
    config.mesh.shard_params = True
    step, inputs = task.build(params0, mesh)
    run, state, inputs, _ = sharding.jit_step(step, mesh, task.make_state(params0), inputs, True)
    instrs = xla_profile.parse_hlo(run.lower(state, inputs).compile().as_text())
    loops = xla_profile.decode_loops(instrs)
    kinds = [instrs[k[0]]["opcode"].removesuffix("-start") for lp in loops for k in lp["kernels"]]
    out["decode_loops"] = len(loops)
    out["loop_collectives"] = [k for k in kinds if k in hlo_collectives.COLLECTIVES]
    out["step_collectives"] = hlo_collectives.collectives(instrs)
    out["sharded_leaves"] = sum(
        1 for x in jax.tree.leaves(state.params) if not x.sharding.is_fully_replicated
    )
    out["param_bytes"] = sum(x.nbytes for x in jax.tree.leaves(state.params))
    out["updates"] = config.grpo.num_iterations
    return out


def reference_split():
    """π_ref's per-token log-probs (groups.make_reference_terms, a frozen policy) of K = 8
    members of 2 prompts on (member=8) and on one device: the largest difference, and each
    device's compiled FLOPs of the prompt's prefill plus the members' log-probs. Before the
    reference ran in the member shard_map, GSPMD kept it whole on every member device."""
    from grpo_jax import groups, model, policy
    from grpo_jax.rollout import SamplingParams

    m = model.Transformer(vocab_size=65, num_layers=2, num_heads=2, d_model=64, max_len=48)
    params = model.init_params(m, jax.random.key(0))
    ref = policy.policy_reference(policy.transformer_policy(m, SamplingParams(), 32), 1.0)
    rng = np.random.default_rng(0)
    prompts = policy.TokenPrompts(rng.integers(0, 65, (2, 16), dtype=np.int32), None, {})
    tokens = rng.integers(0, 65, (2, 8, 32), dtype=np.int32)

    def per_token(member_map):
        terms = groups.make_reference_terms(ref, frozenset({"token"}), 0, member_map)

        def run(params, prompts, tokens):
            _, context = ref.prefill(params, prompts)
            return terms(params, context, prompts, tokens)["token"]

        fn = jax.jit(run)
        cost = fn.lower(params, prompts, tokens).compile().cost_analysis()
        return np.asarray(fn(params, prompts, tokens)), (
            cost[0] if isinstance(cost, list) else cost
        )

    one, one_cost = per_token(None)
    mesh = sharding.make_mesh(_mesh_cfg(1, 8))
    split, split_cost = per_token(sharding.make_member_map(mesh))
    return {
        "max_diff": float(np.max(np.abs(one - split))),
        "shape": list(split.shape),
        "flops": {"1x1": one_cost["flops"], "1x8": split_cost["flops"]},
    }


def gradient_sums():
    """The collectives of shakespeare:tiny's sampled and exhaustive steps on (data=8) and
    (data=2 x member=4): their bytes per device, one execution of the step, against the
    params' bytes and the step's μ updates (each sums one gradient)."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import hlo_collectives
    import xla_profile

    out = {}
    for mode, meshes in (("sampled", ((8, 1), (2, 4))), ("exhaustive", ((8, 1), (2, 4)))):
        config = tiny_config(mode)
        task = task_lib.build_task(config, "train")
        params0 = jax.tree.map(np.array, trainer.initial_params(config, task))
        row = {"param_bytes": sum(x.nbytes for x in jax.tree.leaves(params0))}
        row["updates"] = config.grpo.num_iterations
        for data, member in meshes:
            mesh = sharding.make_mesh(_mesh_cfg(data, member))
            step, inputs = task.build(params0, mesh)
            state = task.make_state(params0)
            run, state, inputs, _ = sharding.jit_step(step, mesh, state, inputs)
            instrs = xla_profile.parse_hlo(run.lower(state, inputs).compile().as_text())
            row[f"{data}x{member}"] = hlo_collectives.collectives(instrs)
        out[mode] = row
    return out


SUPERVISED = {  # the supervised steps: (config, its variant, --mode, its batch of 8 rows)
    "shakespeare_pretrain": ("shakespeare", "tiny", "pretrain", {"pretrain.batch_size": 8}),
    "arithmetic_sft": ("arithmetic", "tiny", "pretrain", {"pretrain.batch_size": 8}),
    "fill_in_judge": (
        "fill_in", "tiny", "train_judge",
        {"judge.batch_size": 8, "judge.corruptions": "random,bigram,swap"},
    ),
    "fill_in_pretrain": ("fill_in", "tiny", "pretrain", {"pretrain.batch_size": 8}),
}  # fmt: skip


def supervised():
    """Each supervised step on (data=8) against one device (3 steps: losses, metrics and
    params), and its compiled FLOPs per device on both."""
    out = {}
    for name, (task, variant, mode, over) in SUPERVISED.items():
        config = load_config(task, variant, **{"logging.tensorboard": False, **over})
        out[name] = equivalence(name, 3, config, mode, meshes=((8, 1, False),))
        out[name]["flops"] = work_per_device(config, mode, ((1, 1), (8, 1)))
    over = {"pretrain.batch_size": 12, "mesh.data": 8, "mesh.member": 1}
    config = load_config("shakespeare", "tiny", **over)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp) / "run"
        try:
            trainer.train_and_evaluate(config, str(workdir), "pretrain")
        except ValueError as err:
            out["refused"] = {"error": str(err), "workdir_made": workdir.exists()}
    return out


def _losses(workdir):
    text = (Path(workdir) / "metrics.jsonl").read_text()
    rows = [json.loads(line) for line in text.split("\n") if line]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def resume(source: str, tmp: str, mode: str = "exhaustive"):
    """Resume ``source``'s step-2 checkpoint (written on any mesh) to step 4 on a single
    device and on (data=8) with FSDP-sharded state; returns the losses and where the state
    lives. The config matches the entry-point runs of test_multihost.py."""
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    out = {}
    for name, (d, v, fsdp) in {"single": (1, 1, False), "data8": (8, 1, True)}.items():
        wd = Path(tmp) / name
        (wd / "checkpoints").mkdir(parents=True)
        shutil.copytree(Path(source) / "checkpoints" / "2", wd / "checkpoints" / "2")
        c = tiny_config(mode, **{"train.num_steps": 4, "train.checkpoint_every": 2})
        c.train.eval_every = 100
        c.mesh.data, c.mesh.member, c.mesh.shard_params = d, v, fsdp
        state, _ = trainer.train_and_evaluate(c, str(wd))
        leaf = state.params["embed"]["embedding"]
        out[name] = {
            "losses": _losses(wd),
            "devices": len(leaf.sharding.device_set),
            "spec": str(leaf.sharding.spec),
        }
    return out


if __name__ == "__main__":
    what = sys.argv[1]
    args = sys.argv[2:]
    checks = {"equivalence": equivalence_all, "resume": resume, "split_work": split_work}
    result = {
        **checks,
        "supervised": supervised,
        "few_rows": few_rows,
        "fsdp_rollout": fsdp_rollout,
        "reference_split": reference_split,
        "gradient_sums": gradient_sums,
        "adaptive_sweep": adaptive_sweep,
    }[what](*args)
    print(json.dumps(result))
