"""One layer's decode-step attention in the ways it could be written, each timed alone at the
large model's shapes: which one to build into grpo_jax/model.py, measured before it is built.

On one H100 (experiments/results/gpu_h100_2026-11-27/call3.md) the large model's decode
loop spent 153.6 of its 244.5 kernel-ms per step in reductions: XLA:GPU runs each one-query
attention's matrix-vector products as reduction fusions (the own cache's weighted values 57 µs
a call, about 4x the time to read that cache). Each variant here is the same softmax over the
prompt's keys and the member's own, one query per member:

- ``model``: grpo_jax.model._attention as the decode loop calls it today (two score sets, one
  softmax over both without concatenating them); the reference the others must equal.
- ``values_s_minor``: the same two-part softmax, the member value cache kept ``[B, G, h, d,
  S]`` so that the weighted sum reduces along the minor axis (a row reduction, not a column
  one).
- ``one_softmax`` / ``one_softmax_s_minor``: the two score sets concatenated and one
  ``jax.nn.softmax`` (at one query per member the concatenation is small), value cache in
  today's layout / S minor.
- ``dpa_xla`` / ``dpa_cudnn``: ``jax.nn.dot_product_attention`` per member over its
  [prompt ; own] keys, the prompt's copied to every member at every step (cuDNN takes one key
  set per query batch). A variant the device cannot run is recorded with its error.
- ``rows2`` / ``rows16``: today's two-part softmax, the query padded with 1 / 15 rows of
  zeros in the own cache's two products (its first row kept), so that they are matrix-matrix
  products, which XLA:GPU may run as GEMMs, not as reduction fusions (16: a tensor-core tile).
- ``pallas_m<M>``, one per ``--members`` count M: grpo_jax/decode_kernel.py
  (``model.decode_kernel=pallas``), one Pallas kernel (Triton backend) per decode step and
  layer, a program per (prompt, head, M members): the prompt's keys, shared by its members,
  then only each member's written slots, a chunk of keys at a time under an online softmax. It
  reads the own cache up to the step's slot, where the forms above read all S slots every step.
  On a CPU it runs interpreted (``pallas_interpreted``; its time there means nothing).
- ``flash_s<K>``, one per ``--flash_splits`` count K: grpo_jax/decode_kernel.py's
  ``flash_attention`` (``model.decode_kernel=flash``, whose own cache is one split): jax's
  own Pallas (Triton) flash-decoding kernel
  (``jax.experimental.pallas.ops.gpu.decode_attention.mqa``), called twice and merged by its
  residuals: the prompt read once per (prompt, head) for all its G members' queries, as
  tensor-core products in parallel splits of its keys, then each member's own slots up to
  the step's only, the cache in K parallel splits. Interpreted on a CPU, like
  ``pallas_m<M>``.

Each runs ``--steps`` decode steps in one jitted ``fori_loop`` (the cache donated): step i
writes its key and value at slot i and attends to slots <= i, as the decode loop does. Per
variant: µs per step (median of ``--runs`` calls), its largest deviation from ``model``, and
the least bytes a step reads (prompt keys and values, the whole static member cache) over
that time. The last printed line is the JSON record.

  python experiments/decode_ops.py --out_dir=experiments/results   # the large model's, bf16
  python experiments/decode_ops.py --members=1,4,16                 # the kernel three ways
  python experiments/decode_ops.py --smoke                          # tiny, float32, a CPU
"""

import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from absl import app, flags
from gpu_suite_report import slug  # the suite's file names for a device

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from grpo_jax import decode_kernel
from grpo_jax.model import _NEG_INF, _attention

FLAGS = flags.FLAGS
flags.DEFINE_integer("prompts", 16, "B: prompts per step.")
flags.DEFINE_integer("group", 16, "G: members per prompt.")
flags.DEFINE_integer("heads", 12, "h: attention heads.")
flags.DEFINE_integer("head_dim", 64, "d: per-head width.")
flags.DEFINE_integer("prompt_len", 256, "P: prompt keys per prompt.")
flags.DEFINE_integer("cache", 128, "S: member cache slots (the last decode segment's).")
flags.DEFINE_integer("steps", 64, "Decode steps per timed call (<= --cache).")
flags.DEFINE_integer("runs", 5, "Timed calls per variant (median).")
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "Compute dtype.")
flags.DEFINE_list(
    "members",
    ["1"],
    "pallas: members per program (each a divisor of --group); one variant per count, all in "
    "this process, so the XLA forms compile and run once (a GPU lease's minutes).",
)
flags.DEFINE_integer("warps", 4, "pallas: warps per program (Triton's num_warps).")
flags.DEFINE_list(
    "flash_splits",
    ["1", "4"],
    "flash: parallel splits of the member cache (each a whole number of 32-slot blocks); one "
    "variant per count (flash_s<K>), in this process.",
)
flags.DEFINE_bool("smoke", False, "Tiny sizes in float32 (a CPU, seconds).")
flags.DEFINE_string("out_dir", "", "Also write decode_ops_<device>.json and .md there.")

XLA_FORMS = ("model", "values_s_minor", "one_softmax", "one_softmax_s_minor", "dpa_xla")
XLA_FORMS += ("dpa_cudnn", "rows2", "rows16")
S_MINOR = {"values_s_minor", "one_softmax_s_minor"}
ROWS = {"rows2": 2, "rows16": 16}  # query rows in the own cache's products (zeros but one)


def rows_product(spec: str, x, y, rows: int):
    """``einsum(spec, x, y)`` with x [..., n] as [..., rows, n] (x, then rows - 1 rows of
    zeros; spec names that axis t) and the product's first row kept. The optimisation barriers
    keep XLA's simplifier from folding the padding and the slice back into a one-row product.
    One row is the plain product, without the t axis: a reshape between the product and its
    cast to float32 would keep XLA from fusing them (another kernel per step)."""
    if rows == 1:
        return jnp.einsum(spec.replace("t", ""), x, y)
    x = jnp.pad(x[..., None, :], [(0, 0)] * (x.ndim - 1) + [(0, rows - 1), (0, 0)])
    out = jnp.einsum(spec, jax.lax.optimization_barrier(x), y)
    return jax.lax.optimization_barrier(out)[..., 0, :]


def one_query(q, pk, pv, pmask, ck, cv, mask, s_minor: bool, one_softmax: bool, rows: int = 1):
    """q [B, G, h, d]; pk/pv [B, h, P, d]; pmask [B, P]; ck [B, G, h, S, d]; cv that or, with
    ``s_minor``, [B, G, h, d, S]; mask [S]. Returns [B, G, h, d] in q's dtype.

    ``rows`` > 1: the query (then its weights) padded with zero rows in the own cache's two
    products, whose first row is kept. One query row makes them matrix-vector products, which
    XLA:GPU runs as reduction fusions (the H100 profile's costliest decode kernels); several
    make them matrix-matrix ones, for its GEMM paths."""
    q = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    s_own = rows_product("bghtd,bghsd->bghts", q, ck, rows).astype(jnp.float32)
    s_own = jnp.where(mask, s_own, _NEG_INF)
    s_pre = jnp.einsum("bghd,bhpd->bghp", q, pk).astype(jnp.float32)
    s_pre = jnp.where(pmask[:, None, None, :], s_pre, _NEG_INF)
    own = "bghts,bghds->bghtd" if s_minor else "bghts,bghsd->bghtd"
    own_values = lambda w: rows_product(own, w, cv, rows)
    if one_softmax:
        w = jax.nn.softmax(jnp.concatenate([s_pre, s_own], axis=-1), axis=-1).astype(q.dtype)
        w_pre, w_own = w[..., : pk.shape[2]], w[..., pk.shape[2] :]
        return jnp.einsum("bghp,bhpd->bghd", w_pre, pv) + own_values(w_own)
    m = jnp.maximum(jnp.max(s_own, -1), jnp.max(s_pre, -1))[..., None]
    e_own, e_pre = jnp.exp(s_own - m), jnp.exp(s_pre - m)
    denom = (jnp.sum(e_own, -1) + jnp.sum(e_pre, -1))[..., None]
    out = jnp.einsum("bghp,bhpd->bghd", e_pre.astype(q.dtype), pv)
    out = out + own_values(e_own.astype(q.dtype))
    return (out / denom).astype(q.dtype)


def joint(q, pk, pv, pmask, ck, cv, mask, implementation: str):
    """jax.nn.dot_product_attention per member over [prompt ; own] keys (one query)."""
    b, g, h, d = q.shape
    p = pk.shape[2]
    per_member = lambda x: jnp.broadcast_to(x.transpose(0, 2, 1, 3)[:, None], (b, g, p, h, d))
    k = jnp.concatenate([per_member(pk), ck.transpose(0, 1, 3, 2, 4)], axis=2)
    v = jnp.concatenate([per_member(pv), cv.transpose(0, 1, 3, 2, 4)], axis=2)
    keep = jnp.concatenate([pmask, jnp.broadcast_to(mask, (b, mask.shape[0]))], axis=-1)
    keep = jnp.broadcast_to(keep[:, None, None, None, :], (b, g, 1, 1, keep.shape[-1]))
    fold = lambda x: x.reshape(b * g, *x.shape[2:])
    out = jax.nn.dot_product_attention(
        fold(q[:, :, None]), fold(k), fold(v), mask=fold(keep), implementation=implementation
    )
    return out.reshape(b, g, h, d)


def step_fn(variant: str):
    """(q, k_new, v_new, pk, pv, pmask, ck, cv, i) -> (out [B, G, h, d], ck, cv)."""
    s_minor = variant in S_MINOR

    def step(q, k_new, v_new, pk, pv, pmask, ck, cv, i):
        ck = jax.lax.dynamic_update_slice_in_dim(ck, k_new[:, :, :, None], i, 3)
        if s_minor:
            cv = jax.lax.dynamic_update_slice_in_dim(cv, v_new[..., None], i, 4)
        else:
            cv = jax.lax.dynamic_update_slice_in_dim(cv, v_new[:, :, :, None], i, 3)
        mask = jnp.arange(ck.shape[3]) <= i
        if variant == "model":  # today's code path: q [B, G, T=1, h, d]
            out = _attention(q[:, :, None], pk, pv, pmask, ck, cv, mask[None, :], q.dtype)
            return out[:, :, 0], ck, cv
        if variant.startswith("pallas_m"):
            members = int(variant.removeprefix("pallas_m"))
            out = decode_kernel.attention(q, pk, pv, pmask, ck, cv, i, members, FLAGS.warps)
            return out, ck, cv
        if variant.startswith("flash_s"):
            splits = int(variant.removeprefix("flash_s"))
            return decode_kernel.flash_attention(q, pk, pv, pmask, ck, cv, i, splits), ck, cv
        if variant.startswith("dpa_"):
            return joint(q, pk, pv, pmask, ck, cv, mask, variant[4:]), ck, cv
        one = "one_softmax" in variant
        return one_query(q, pk, pv, pmask, ck, cv, mask, s_minor, one, ROWS.get(variant, 1)), ck, cv

    return step


def inputs(key, dtype):
    """Random queries, new keys/values, a prompt cache with its first quarter padded out, and
    an empty member cache, at the flags' sizes."""
    b, g, h, d = FLAGS.prompts, FLAGS.group, FLAGS.heads, FLAGS.head_dim
    p, s = FLAGS.prompt_len, FLAGS.cache
    ks = jax.random.split(key, 5)
    normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(dtype)
    q, k_new, v_new = (normal(k, (b, g, h, d)) for k in ks[:3])
    pk, pv = normal(ks[3], (b, h, p, d)), normal(ks[4], (b, h, p, d))
    # left padding: a quarter of the prompt, at --smoke one whole chunk of the Pallas kernel
    pmask = jnp.broadcast_to(jnp.arange(p) >= p // 4, (b, p))
    return (q, k_new, v_new, pk, pv, pmask), jnp.zeros((b, g, h, s, d), dtype)


def run_loop(variant: str):
    """A jitted loop of --steps decode steps (member cache donated): returns (sum of every
    step's output in float32, the caches). Each step's new key and value are scaled by its
    index, so no two steps write the same slot contents."""
    step = step_fn(variant)

    def loop(args, ck, cv):
        q, k_new, v_new, pk, pv, pmask = args

        def body(i, carry):
            ck, cv, acc = carry
            scale = (1.0 + i / FLAGS.steps).astype(k_new.dtype)
            out, ck, cv = step(q, k_new * scale, v_new * scale, pk, pv, pmask, ck, cv, i)
            return ck, cv, acc + out.astype(jnp.float32)

        acc = jnp.zeros(q.shape, jnp.float32)
        return jax.lax.fori_loop(0, FLAGS.steps, body, (ck, cv, acc))

    return jax.jit(loop, donate_argnums=(1, 2))


def measure(variant: str, args, empty, want) -> dict:
    """One variant: compile, one checked call, --runs timed calls."""
    cv0 = empty.swapaxes(3, 4) if variant in S_MINOR else empty
    loop = run_loop(variant)
    try:
        t0 = time.perf_counter()
        compiled = loop.lower(args, empty, cv0).compile()
        compile_s = time.perf_counter() - t0
        _, _, got = jax.block_until_ready(compiled(args, empty.copy(), cv0.copy()))
    except Exception as e:  # e.g. cuDNN's attention on a CPU, or at one query per member
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    times = []
    for _ in range(FLAGS.runs):
        ck, cv = empty.copy(), cv0.copy()
        jax.block_until_ready((ck, cv))
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(args, ck, cv))
        times.append(time.perf_counter() - t0)
    err = None if want is None else float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    return {"us_per_step": 1e6 * statistics.median(times) / FLAGS.steps, "compile_s": compile_s,
            "max_rel_deviation": err, "output": got}  # fmt: skip


def counts(name: str, fits, needs: str) -> list[int]:
    """A list flag ``--name`` as positive integers, each one ``fits``."""
    given = getattr(FLAGS, name)
    try:
        values = [int(m) for m in given]
    except ValueError:
        raise app.UsageError(f"--{name}={','.join(given)}: give integers, e.g. 1,4") from None
    if not values:
        raise app.UsageError(f"--{name} is empty: give counts, e.g. 1,4")
    bad = [m for m in values if m < 1 or not fits(m)]
    if bad:
        raise app.UsageError(f"--{name}: {bad} {needs}")
    return values


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.smoke:
        tiny = dict(prompts=2, group=4, heads=2, head_dim=8, prompt_len=128, cache=64, steps=40)
        # the cache's two 32-slot blocks in one or two splits
        for name, value in dict(tiny, runs=2, dtype="float32", flash_splits=["1", "2"]).items():
            setattr(FLAGS, name, value)
    if FLAGS.steps > FLAGS.cache:
        raise app.UsageError(f"--steps={FLAGS.steps} exceeds --cache={FLAGS.cache}: set them equal")
    dtype = jnp.dtype(FLAGS.dtype)
    args, empty = inputs(jax.random.PRNGKey(0), dtype)
    b, g, h, d = args[0].shape
    item = dtype.itemsize
    # the least a step reads: the prompt's keys and values, the whole static member cache
    step_bytes = item * (2 * b * h * FLAGS.prompt_len * d + 2 * b * g * h * FLAGS.cache * d)
    results, want = {}, None
    # the kernel's programs split a prompt's members evenly
    members = counts("members", lambda m: FLAGS.group % m == 0, f"do not divide --group={g}")
    blocks = f"do not split --cache={FLAGS.cache} into {decode_kernel.BLOCK}-slot blocks"
    splits = counts("flash_splits", lambda k: FLAGS.cache % (k * decode_kernel.BLOCK) == 0, blocks)
    variants = (*XLA_FORMS, *(f"pallas_m{m}" for m in members), *(f"flash_s{k}" for k in splits))
    for variant in variants:
        res = measure(variant, args, empty, want)
        want = res.pop("output", want) if variant == "model" else want
        res.pop("output", None)
        if "us_per_step" in res:
            res["read_gb_per_s"] = step_bytes / res["us_per_step"] / 1e3
        results[variant] = res
        print(f"{variant}: {res}", flush=True)
    dev = jax.devices()[0]
    record = {
        "device": f"{dev.device_kind} ({dev.platform})",
        "jax": jax.__version__,
        "dtype": FLAGS.dtype,
        "command": " ".join(["python experiments/decode_ops.py", *sys.argv[1:]]),
        "shapes": dict(B=b, G=g, h=h, d=d, P=FLAGS.prompt_len, S=FLAGS.cache, steps=FLAGS.steps),
        "pallas": dict(members=members, warps=FLAGS.warps),
        "flash": dict(
            own_splits=splits,
            prompt_splits=decode_kernel.FLASH_PROMPT_SPLITS,
            block=decode_kernel.BLOCK,
        ),
        "step_bytes": step_bytes,
        "pallas_interpreted": jax.default_backend() == "cpu",
        "variants": results,
    }
    if FLAGS.out_dir:
        stem = Path(FLAGS.out_dir) / f"decode_ops_{slug(dev.device_kind)}"
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
        stem.with_suffix(".md").write_text(markdown(record))
    print(json.dumps(record))


def markdown(rec: dict) -> str:
    """The record as a table, fastest first."""
    shapes = ", ".join(f"{k} = {v}" for k, v in rec["shapes"].items())
    lines = [
        f"# One decode step's attention, per form ({rec['device']})",
        "",
        f"jax {rec['jax']}, {rec['dtype']}; {shapes}; `{rec['command']}`"
        + (" (the Pallas kernel interpreted)" if rec["pallas_interpreted"] else ""),
        "",
        "| form | µs / step | cache read GB/s | max deviation from `model` | compile s |",
        "| --- | --- | --- | --- | --- |",
    ]
    timed = lambda item: item[1].get("us_per_step", float("inf"))
    for name, r in sorted(rec["variants"].items(), key=timed):
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | |")
            continue
        dev = "–" if r["max_rel_deviation"] is None else f"{r['max_rel_deviation']:.1e}"
        lines.append(f"| {name} | {r['us_per_step']:.1f} | {r['read_gb_per_s']:.0f} | {dev} | "
                     f"{r['compile_s']:.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    app.run(main)
