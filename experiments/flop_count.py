"""The matmul FLOPs a traced program executes, from its jaxpr (the roofline's numerator:
experiments/benchmark.py, profile_step.py, scaling.py and the GPU suite's MFU).

Every ``dot_general`` counts 2·M·N·K times the runs of the computation holding it: a scan's
body ``length`` times, a shard_map's body once per device of its manual axes, a
``lax.platform_dependent`` branch as this backend runs it (else the costliest), a while loop's
body once (its trip count is not static), the backward pass and any recomputation included.
Fused kernels count as the products they run (cuDNN attention, a Pallas kernel's
dot_generals per grid program); matmul work no rule sizes is reported, never counted as 0.
"""

import functools
import math

import jax
import jax.numpy as jnp


def _sub_jaxprs(eqn):
    """(jaxpr, multiplier) of every sub-computation of one equation."""
    name, p = eqn.primitive.name, eqn.params
    if name == "cond":  # one branch runs: this backend's, else the most expensive bounds it
        i = platform_branch(p)
        if i is not None:
            return [(p["branches"][i].jaxpr, 1)]
        costliest = lambda j: matmul_flops_of(j, uncounted=[])
        return [(max((br.jaxpr for br in p["branches"]), key=costliest), 1)]
    times = p["length"] if name == "scan" else 1
    if name == "shard_map":
        times = manual_devices(p)
    out = []
    for v in p.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            inner = getattr(x, "jaxpr", x)
            if hasattr(inner, "eqns"):
                out.append((inner, times))
    return out


def platform_branch(params: dict) -> int | None:
    """The branch of a ``lax.platform_dependent`` cond that this process's backend runs (its
    ``branches_platforms`` name lowering platforms, None the default), or None for any other
    cond and for one with neither this backend's branch nor a default (the costliest counts).
    The count is this backend's: a CPU counting a GPU config (--flops_only) misses what only
    the GPU branch runs (products.lookup's one-hot gradient matmul)."""
    plats = params.get("branches_platforms")
    if not plats:
        return None
    backend = jax.default_backend()
    here = {backend} | ({"cuda", "rocm"} if backend == "gpu" else set())
    for i, names in enumerate(plats):
        if names is not None and here & set(names):
            return i
    return plats.index(None) if None in plats else None


def manual_devices(params: dict) -> int:
    """How many blocks of a shard_map's body its mesh runs: the product of the sizes of its
    manual axes. The body's shapes are one device's block along those axes only; along the
    mesh's automatic ones (the member map leaves ``data`` to the partitioner) they are whole,
    and the partitioner splits that work over the devices without repeating it, so counting
    every device of the mesh would count it once per automatic shard too. jax 0.10 names
    the axes ``newly_manual_axes``, jax 0.6 ``manual_axes``."""
    for key in ("newly_manual_axes", "manual_axes"):
        if key in params:
            return math.prod(params["mesh"].shape[a] for a in params[key])
    raise KeyError(f"a shard_map equation without its manual axes: {sorted(params)}")


def is_batched(params: dict) -> bool:
    """Whether a dot_general (its equation's params) has batch dimensions: attention's
    scores and values, as against the dense layers."""
    return bool(params["dimension_numbers"][1][0])


# Primitives holding matmul work that the counter does not size from their operands: met in a
# traced program, each is reported (executed_dots's ``uncounted``), never counted as 0 silently.
UNCOUNTED_MATMULS = {
    **dict.fromkeys(
        ("dot_product_attention_fp8_fwd", "dot_product_attention_fp8_fwd_wrapper",
         "dot_product_attention_fp8_bwd", "dot_product_attention_fp8_bwd_wrapper"),
        "cuDNN's fp8 fused attention",
    ),
    **dict.fromkeys(("scaled_matmul", "scaled_matmul_wrapper"), "cuDNN's block-scaled matmul"),
    "ragged_dot_general": "a grouped matmul: its groups' sizes are data",
    "conv_general_dilated": "a convolution",
    "triton_kernel_call": "a Triton kernel called from outside Pallas",
}  # fmt: skip
# jax's cuDNN fused (flash) attention, jax.nn.dot_product_attention(implementation="cudnn"):
# the primitives make_jaxpr shows (the wrappers) and those they bind -> which pass
CUDNN_ATTENTION = {
    "dot_product_attention_fwd_wrapper": "forward", "dot_product_attention_fwd": "forward",
    "dot_product_attention_bwd_wrapper": "backward", "dot_product_attention_bwd": "backward",
}  # fmt: skip


class UncountedMatmulError(ValueError):
    """A traced program holds matmul work the counter cannot size (UNCOUNTED_MATMULS, a
    cuDNN attention that skips tiles, a Pallas kernel without dot_generals)."""


def executed_dots(jaxpr, times: int = 1, uncounted: list | None = None):
    """(dot_general equation, how many times it runs) for every matmul a jaxpr executes: a
    scan's body runs ``length`` times, a while loop's once (its trip count is not static).

    Fused kernels count as the dot_generals they run: jax's cuDNN attention as its batched
    products (cudnn_attention_dots), a Pallas kernel as its kernel's dot_generals once per
    program of its grid (pallas_dots). Work none of these rules sizes (UNCOUNTED_MATMULS, and
    what those two refuse) is appended to ``uncounted`` as {primitive, op, runs, why}, or,
    with no list, raises UncountedMatmulError: a new kernel cannot silently count as 0."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            yield eqn, times
        elif name in CUDNN_ATTENTION or name == "pallas_call":
            if name in CUDNN_ATTENTION:
                dots, why = cudnn_attention_dots(eqn)
            else:
                dots, why = pallas_dots(eqn, uncounted)
            if why is not None:
                _uncounted(eqn, times, why, uncounted)
            yield from ((dot, times * n) for dot, n in dots)
        elif name in UNCOUNTED_MATMULS:
            _uncounted(eqn, times, UNCOUNTED_MATMULS[name], uncounted)
        else:
            for sub, n in _sub_jaxprs(eqn):
                yield from executed_dots(sub, times * n, uncounted)


def _uncounted(eqn, runs: int, why: str, uncounted: list | None) -> None:
    entry = {"primitive": eqn.primitive.name, "op": str(eqn.source_info.name_stack)}
    entry.update(runs=runs, why=why)
    if uncounted is None:
        raise UncountedMatmulError(
            f"{entry['primitive']} (op {entry['op']!r}, {runs} runs) holds matmul work the "
            f"counter does not size: {why}. Pass a list as ``uncounted`` to collect it instead."
        )
    uncounted.append(entry)


def merged_uncounted(entries: list) -> list:
    """executed_dots's ``uncounted`` entries, one per (primitive, op, why), runs summed."""
    out = {}
    for e in entries:
        key = (e["primitive"], e["op"], e["why"])
        out.setdefault(key, {**e, "runs": 0})["runs"] += e["runs"]
    return list(out.values())


def cudnn_attention_dots(eqn):
    """(the dot_generals one cuDNN fused-attention equation runs, each once; None) or ([],
    why not). The operands are q [B, T, N, H], keys [B, S, N or fewer, H], values [B, S, .,
    Hv] (``layout`` 0; 1 is BNTH), so with the model's mask as a bias (mask_type NO_MASK)
    the kernel computes every one of the T x S scores:

    - forward: S = QKᵀ and O = PV, 2·B·N·T·S·(H + Hv): the same dot_generals as jax's
      ``xla`` implementation of the same call (attention_dots);
    - backward: the flash backward's five products, 2·B·N·T·S·(3H + 2Hv): S = QKᵀ
      recomputed (P is rebuilt from the saved softmax statistics, not stored), dP = dO Vᵀ,
      dV = Pᵀ dO, dQ = dS K, dK = dSᵀ Q. The ``xla`` path's gradient runs only the last
      four (8·B·N·T·S·H at H = Hv): it keeps P from its forward pass. Both count what the
      hardware executes.

    A causal or sliding-window mask, per-sequence lengths or packed or paged keys let the
    kernel skip tiles, which its tiling and the data decide: not sized, reported instead."""
    p, (q, k, v) = eqn.params, (x.aval for x in eqn.invars[:3])
    mask = getattr(p.get("mask_type"), "name", p.get("mask_type"))
    skips = [f"mask {mask}"] if mask != "NO_MASK" else []
    skips += ["a sliding window"] if p.get("sliding_window_length") is not None else []
    if any(x.aval.size for x in eqn.invars[4:10]):  # q/kv lengths, offsets, page tables
        skips.append("sequence lengths, packed offsets or page tables")
    if skips:
        return [], "cuDNN attention that skips tiles as its tiling decides: " + ", ".join(skips)
    btnh = (lambda s: s) if p.get("layout", 0) == 0 else (lambda s: (s[0], s[2], s[1], s[3]))
    (b, t, n, h), s, hv = btnh(q.shape), btnh(k.shape)[1], v.shape[-1]
    backward = CUDNN_ATTENTION[eqn.primitive.name] == "backward"
    dots = attention_dots(b, t, s, n, h, hv, str(q.dtype), str(v.dtype), backward)
    return [(dot.replace(source_info=eqn.source_info), 1) for dot in dots], None


@functools.cache
def attention_dots(b, t, s, n, h, hv, dtype, v_dtype, backward: bool) -> tuple:
    """The dot_generals (batched over B and N) of attention over q [b, t, n, h], keys
    [b, s, n, h] and values [b, s, n, hv], written as jax's ``xla`` implementation writes its
    two products (BTNH einsums); ``backward``: the five of cudnn_attention_dots's flash
    backward. Keys with fewer heads (grouped queries) are counted at the queries' n heads."""
    sd = jax.ShapeDtypeStruct
    q, k, v = sd((b, t, n, h), dtype), sd((b, s, n, h), dtype), sd((b, s, n, hv), v_dtype)
    grad_out, probs = sd((b, t, n, hv), dtype), sd((b, n, t, s), v_dtype)  # probs: P or dS
    f32 = jnp.float32
    scores = lambda a, c: jnp.einsum("BTNH,BSNH->BNTS", a, c, preferred_element_type=f32)
    mix = lambda p, c: jnp.einsum("BNTS,BSNH->BTNH", p, c)  # PV, dQ = dS K
    back = lambda p, a: jnp.einsum("BNTS,BTNH->BSNH", p, a)  # dV = Pᵀ dO, dK = dSᵀ Q
    if backward:
        f = lambda q, k, v, do, p: [scores(q, k), scores(do, v), back(p, do), mix(p, k), back(p, q)]
        args = (q, k, v, grad_out, probs)
    else:
        f, args = (lambda q, k, v, p: [scores(q, k), mix(p, v)]), (q, k, v, probs)
    return tuple(eqn for eqn, _ in executed_dots(jax.make_jaxpr(f)(*args).jaxpr))


def pallas_dots(eqn, uncounted=None):
    """(the dot_generals of a pallas_call's kernel, each times the programs of its grid; None),
    or ([], why not): a dynamic grid, or a kernel with no dot_general. A kernel that
    computes its products as multiplies and sums (decode_kernel.py's attention: one query
    per member, no matmul unit) states no matmul in its jaxpr, and reading one out of its
    elementwise ops would be guesswork: it is reported, and its products left uncounted.
    Loops in the kernel count as elsewhere (a while loop's body once)."""
    kernel, grid = eqn.params["jaxpr"], eqn.params["grid_mapping"].grid
    name = getattr(kernel.debug_info, "func_src_info", None) or "a Pallas kernel"
    if not all(isinstance(g, int) for g in grid):
        return [], f"{name}: a dynamic grid {grid}"
    dots = list(executed_dots(kernel, math.prod(grid), uncounted))
    if not dots:
        return [], f"{name}: no dot_general in its kernel (its products, if any, not sized)"
    return dots, None


def matmul_flops_of(jaxpr, batched: bool | None = None, uncounted: list | None = None) -> int:
    """Matmul FLOPs (2·M·N·K per dot_general) a jaxpr executes, loops and fused kernels
    included (executed_dots, which fills ``uncounted`` or raises). ``batched``: None counts
    every dot_general, True only those with batch dimensions (attention's scores and values,
    cuDNN's included), False only those without (the dense layers)."""
    total = 0
    for eqn, times in executed_dots(jaxpr, uncounted=uncounted):
        if batched is None or batched == is_batched(eqn.params):
            total += times * dot_flops(eqn)
    return total


def loop_matmul_flops(jaxpr, uncounted: list | None = None) -> int:
    """The part of matmul_flops_of(jaxpr) that runs inside a scan (at any depth): in a
    rollout, its decode loop, the steps that run one after another; what is left (the prompt
    prefill, the reference's pass over the completions) runs as whole-sequence passes. Fused
    kernels are not looked into (a Pallas kernel's own loops are the kernel's)."""
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "scan":
            for sub, n in _sub_jaxprs(eqn):
                total += sum(t * dot_flops(d) for d, t in executed_dots(sub, n, uncounted))
        elif name != "pallas_call" and name not in CUDNN_ATTENTION:
            total += sum(n * loop_matmul_flops(sub, uncounted) for sub, n in _sub_jaxprs(eqn))
    return total


def dot_flops(eqn) -> int:
    """2·M·N·K of one dot_general equation: every output element sums over the contracted
    dimensions."""
    (lc, _), _ = eqn.params["dimension_numbers"]
    contracted = math.prod(eqn.invars[0].aval.shape[d] for d in lc)
    return 2 * math.prod(eqn.outvars[0].aval.shape) * contracted


def step_flops(fn, *args, compiled=None):
    """The FLOPs of one call of ``fn(*args)``.

    ``matmul_flops``: every dot_general the traced program executes, each scan body counted
    ``length`` times (the rollout's decode loop, the μ updates, the member chunks) and the
    backward pass's recomputation included, fused kernels as the products they run
    (executed_dots): the work the hardware does, the roofline's numerator.
    ``loop_matmul_flops``: the part of it inside scans (loop_matmul_flops).
    ``matmul_uncounted`` (only where there is any): the matmul work it holds that the count
    leaves out (merged_uncounted), e.g. model.decode_kernel=pallas's decode attention.
    ``xla_flops``: XLA's own cost analysis of the compiled executable (all ops, but a loop
    body counted once, whatever its trip count: a lower bound for a step with loops)."""
    uncounted = []
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    out = {"matmul_flops": int(matmul_flops_of(jaxpr, uncounted=uncounted))}
    out["loop_matmul_flops"] = int(loop_matmul_flops(jaxpr, uncounted=[]))
    if uncounted:
        out["matmul_uncounted"] = merged_uncounted(uncounted)
    if compiled is not None:
        ca = compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        if ca and "flops" in ca:
            out["xla_flops"] = int(ca["flops"])
    return out
