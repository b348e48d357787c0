"""experiments/profile_step.py: HLO parsing, classification and the trace's thunk times, on a
small program whose instructions are known (a dense matmul, a batched one inside a scan under
the "rollout" scope, a transpose)."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import hlo_collectives as C
import xla_profile as P

LOOP = 5


def _program(x, w, q, k):
    """A dense matmul, then a scan of LOOP pairs of batched matmuls (scores [16, 8, 24] and
    values [16, 8, 32]) named like the engine's rollout."""
    y = jnp.tanh(x @ w)

    @jax.named_scope("rollout")
    def loop(q):
        @jax.named_scope("Transformer.decode")
        def body(c, _):
            return jnp.tanh(jnp.einsum("bqd,bkd->bqk", c, k) @ k), None

        return jax.lax.scan(body, q, None, length=LOOP)[0]

    return jnp.sum(y) + jnp.sum(loop(q)), y.T + 1.0


@pytest.fixture(scope="module")
def profiled():
    args = (jnp.ones((64, 128)), jnp.full((128, 96), 0.01), jnp.ones((16, 8, 32)),
            jnp.full((16, 24, 32), 0.01))  # fmt: skip
    compiled = jax.jit(_program).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    trace_dir, wall = P.traced(lambda: jax.block_until_ready(compiled(*args)), steps=3)
    text = compiled.as_text()
    instrs = P.parse_hlo(text)
    assert P.module_name(text) == "jit__program"
    return instrs, P.thunk_times(trace_dir, instrs, P.module_name(text), steps=3), wall


def test_instructions_are_classified_by_kind_and_stage(profiled):
    instrs, (times, lost), _ = profiled
    assert lost["events_per_step"] == 0, lost  # on a CPU every thunk of the module is named
    kinds = {}
    for name in times:
        kinds.setdefault(P.kind_of(name, instrs[name]), []).append(name)
    # one dense [64, 128] x [128, 96] matmul (the tanh may be fused with it)
    dense = [n for n in kinds["matmul"] if instrs[n]["shape"].startswith("f32[64,96]")]
    assert len(dense) == 1
    assert P.stage_of(instrs[dense[0]]["op_name"]) == "other"  # outside any engine scope
    # the loop's batched matmul: named by its own op_name or its while loop's
    (bmm,) = [n for n in kinds["batched matmul"] if instrs[n]["shape"].startswith("f32[16,8,24]")]
    assert P.stage_of(instrs[bmm]["op_name"]).startswith("rollout")
    assert times[bmm][1] == pytest.approx(LOOP)  # calls per step: the scan's trip count
    assert "layout" in kinds  # y.T materialised
    assert not {instrs[n]["opcode"] for n in times} & P.CONTROL  # loops are not summed


def test_stage_rules_follow_the_engine_scopes_and_transformations():
    assert P.stage_of("jit(fused)/rollout/reference/Transformer.extend/blocks_0/fc") == (
        "rollout: reference"
    )
    assert P.stage_of("jit(fused)/rollout/while/body/Transformer.decode/blocks_1/qkv") == (
        "rollout: decode loop"
    )
    assert P.stage_of("transpose(jvp(Transformer.extend))/blocks_0/fc") == "update: backward"
    assert P.stage_of("jit(fused)/update/while/body/jvp(Transformer.extend)/x") == (
        "update: forward"
    )
    assert P.stage_of("jit(fused)/update/while/body/optimizer/mul") == "update: optimizer"
    assert P.stage_of("") == "other"


def test_summary_adds_up_and_the_markdown_names_every_stage(profiled):
    instrs, (times, lost), wall = profiled
    res = P.summarise(instrs, (times, lost), wall, top=3)
    total = sum(ms for ms, _ in times.values())
    assert res["thunk_ms_per_step"] == pytest.approx(total)
    assert sum(res["by_kind"].values()) == pytest.approx(total)
    assert sum(sum(r.values()) for r in res["by_stage_and_kind"].values()) == pytest.approx(total)
    assert [r["thunk_ms"] for r in res["top"]] == sorted(
        (ms for ms, _ in times.values()), reverse=True
    )[:3]
    res.update(name="t", when="now", machine="m", device="d", jax=jax.__version__,
               dtype="float32", command="c", steps=3,
               matmul_gflop_per_step={"matmul": 1.0, "batched matmul": 0.5})  # fmt: skip
    md = P.markdown(res)
    for stage in res["by_stage"]:
        assert f"| {stage} |" in md
    assert "The costliest source ops of each stage (3 per stage), every layer's" in md
    assert "67 % of the matmul FLOPs" in md


HLO = """
%body.1 (p: (s32[], f32[4,1,8])) -> (s32[], f32[4,1,8]) {
  %p = (s32[], f32[4,1,8]) parameter(0)
  %dot.7 = f32[4,1,8]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
  ROOT %tuple.9 = (s32[], f32[4,1,8]) tuple(%i, %dot.7)
}

%fused_computation.4 (param_0: f32[4,8]) -> f32[8,4] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  ROOT %transpose.5 = f32[8,4]{1,0} transpose(%param_0), dimensions={1,0}
}

ENTRY %main.2 (x: f32[4,8]) -> f32[8,4] {
  %while.3 = (s32[], f32[4,1,8]{2,1,0}) while(%tuple.1), condition=%cond.1, body=%body.1, metadata={op_name="jit(fused)/rollout/while"}
  ROOT %transpose_copy_fusion.4 = f32[8,4]{1,0} fusion(%x), kind=kLoop, calls=%fused_computation.4, metadata={op_name="jit(fused)/update/while/body/jvp(f)/transpose"}
}
"""  # noqa: E501  (an HLO module's lines as XLA prints them)


def test_an_unnamed_loop_body_instruction_takes_its_loops_name():
    """XLA drops the op_name of some decode-loop instructions: they inherit the while's, and
    a tuple-shaped instruction (with spaces in its shape) still parses."""
    instrs = P.parse_hlo(HLO)
    dot = instrs["dot.7"]
    assert dot["op_name"] == "jit(fused)/rollout/while"
    assert P.kind_of("dot.7", dot) == "batched matmul"
    assert P.stage_of(dot["op_name"]) == "rollout: decode loop"
    assert instrs["while.3"]["opcode"] == "while"
    assert instrs["while.3"]["shape"] == "(s32[], f32[4,1,8]{2,1,0})"
    fusion = instrs["transpose_copy_fusion.4"]
    assert fusion["body"] == ["parameter", "transpose"]
    assert P.kind_of("transpose_copy_fusion.4", fusion) == "layout"
    assert P.stage_of(fusion["op_name"]) == "update: forward"


GPU_HLO = """
%gemm_fusion_dot.12_computation (parameter_0: bf16[64,128], parameter_1: bf16[128,256]) -> bf16[64,256] {
  %parameter_0 = bf16[64,128]{1,0} parameter(0)
  %parameter_1 = bf16[128,256]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,256]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.2 (a: bf16[64,128], b: bf16[128,256]) -> bf16[64,256] {
  %custom-call.3 = (bf16[64,256]{1,0}, s8[4194304]{0}) custom-call(bf16[64,128]{1,0} %a, bf16[128,256]{1,0} %b), custom_call_target="__cublas$gemm", metadata={op_name="jit(fused)/update/transpose(jvp(Transformer.extend))/blocks_0/fc/dot_general"}, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"gemm_backend_config":{"alpha_real":1,"alpha_imag":0,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"precision_config":{"operand_precision":["DEFAULT","DEFAULT"]},"epilogue":"DEFAULT","grad_x":false,"grad_y":false}}
  %cublas-lt-matmul.4 = (bf16[4,64,64]{2,1,0}, s8[0]{0}) custom-call(bf16[4,64,32]{2,1,0} %c, bf16[4,32,64]{2,1,0} %d), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":["0"],"rhs_batch_dimensions":["0"]},"epilogue":"DEFAULT"}}
  %custom-call.5 = (bf16[4,64,2,32]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v, %bias), custom_call_target="__cudnn$fmhaScaleBiasSoftmax", backend_config={"cudnn_fmha_backend_config":{"bmm1_dot_dimension_numbers":{"lhs_batch_dimensions":["0","2"]}}}
  %gemm_fusion_dot.12 = bf16[64,256]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion_dot.12_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  ROOT %custom-call.6 = f32[64]{0} custom-call(%a), custom_call_target="SomeOtherCall"
}
"""  # noqa: E501  (an optimised XLA:GPU module's lines as XLA prints them)


def test_gpu_library_calls_are_filed_as_the_matmuls_they_are():
    """On a GPU most matmuls are custom-calls holding no dot: a cuBLAS GEMM is a matmul
    (batched when its backend config names batch dimensions), cuDNN's fused attention a
    batched matmul, a Triton GEMM fusion a matmul by its body; any other custom call stays
    elementwise. (The first H100 profile filed the GEMMs as elementwise: its matmul row
    implied 2,000 TFLOP/s.)"""
    instrs = P.parse_hlo(GPU_HLO)
    kinds = {name: P.kind_of(name, info) for name, info in instrs.items()}
    assert instrs["custom-call.3"]["target"] == "__cublas$gemm"
    assert kinds["custom-call.3"] == "matmul"
    assert kinds["cublas-lt-matmul.4"] == "batched matmul"
    assert kinds["custom-call.5"] == "batched matmul"
    assert kinds["gemm_fusion_dot.12"] == "matmul"
    assert kinds["custom-call.6"] == "elementwise"
    assert P.stage_of(instrs["custom-call.3"]["op_name"]) == "update: backward"


def test_device_tracks_count_kernels_and_report_what_names_no_instruction(tmp_path):
    """A GPU-shaped trace: only the device track's kernels count (the host's launches would
    count them twice); an ``hlo_op`` given as a path still names its instruction; kernels with
    no instruction of the module (a CUDA graph's, another module's) are reported, not lost,
    and a profile where nothing is attributed still renders."""
    instrs = P.parse_hlo(HLO)
    mod = {"hlo_module": "jit_fused"}
    events = [
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 7, "dur": 300, "args": {**mod, "hlo_op": "dot.7"}},
        {"ph": "X", "pid": 7, "dur": 100, "args": {**mod, "hlo_op": "x/transpose_copy_fusion.4"}},
        {"ph": "X", "pid": 7, "dur": 50, "args": {**mod, "hlo_op": "while.3"}},  # control
        {"ph": "X", "pid": 7, "dur": 40, "name": "graph_kernel", "args": {}},
        {"ph": "X", "pid": 7, "dur": 20, "args": {"hlo_module": "other", "hlo_op": "dot.7"}},
        {"ph": "X", "pid": 1, "dur": 900, "args": {**mod, "hlo_op": "dot.7"}},  # the launch
    ]
    (tmp_path / "run").mkdir()
    with gzip.open(tmp_path / "run" / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    times, lost = P.thunk_times(str(tmp_path), instrs, "jit_fused", steps=2)
    assert times == {"dot.7": (0.15, 0.5), "transpose_copy_fusion.4": (0.05, 0.5)}
    assert lost["ms_per_step"] == pytest.approx(0.03) and lost["events_per_step"] == 1.0
    assert set(lost["names"]) == {"graph_kernel", "dot.7"}
    res = P.summarise(instrs, ({}, lost), 1e-3, top=3)
    res.update(name="t", when="now", machine="m", device="d", jax=jax.__version__,
               dtype="float32", command="c", steps=2,
               matmul_gflop_per_step={"matmul": 1.0})  # fmt: skip
    assert "not attributed to an instruction: 0.03 ms per step in 1 events" in P.markdown(res)


LOOPS_HLO = """
%decode_body (p: (s32[], bf16[2,8])) -> (s32[], bf16[2,8]) {
  %p = (s32[], bf16[2,8]) parameter(0)
  %gte.1 = bf16[2,8]{1,0} get-tuple-element(%p), index=1
  %loop_convert_fusion.2 = bf16[2,8]{1,0} fusion(%gte.1), kind=kLoop, calls=%c1, metadata={op_name="jit(fused)/rollout/while/body/closed_call/Transformer.decode/blocks_0/ln1/convert_element_type"}
  %gemm_fusion_dot.3 = bf16[2,8]{1,0} fusion(%loop_convert_fusion.2), kind=kCustom, calls=%c2, metadata={op_name="jit(fused)/rollout/while/body/closed_call/Transformer.decode/blocks_0/qkv/dot_general"}
  %pallas_call.4 = bf16[2,8]{1,0} custom-call(%gemm_fusion_dot.3), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(fused)/rollout/while/body/closed_call/Transformer.decode/blocks_1/pallas_call"}
  %bitcast.5 = bf16[16]{0} bitcast(%pallas_call.4)
  %constant.6 = s32[] constant(1)
  %triton_softmax.7 = f32[2,8]{1,0} fusion(%pallas_call.4), kind=kCustom, calls=%c3
  ROOT %tuple.8 = (s32[], bf16[2,8]) tuple(%constant.6, %pallas_call.4)
}

%ref_body (r: (s32[], s32[4])) -> (s32[], s32[4]) {
  %r = (s32[], s32[4]) parameter(0)
  ROOT %fusion.14 = (s32[], s32[4]) fusion(%r), kind=kLoop, calls=%c5, metadata={op_name="jit(fused)/rollout/reference/jit(searchsorted)/add"}
}

%update_body (q: (s32[], f32[2])) -> (s32[], f32[2]) {
  %q = (s32[], f32[2]) parameter(0)
  %all-reduce-start.16 = f32[1024]{0} all-reduce-start(%x), replica_groups={{0,1}}, to_apply=%add
  %all-reduce-done.17 = f32[1024]{0} all-reduce-done(%all-reduce-start.16)
  ROOT %fusion.9 = (s32[], f32[2]) fusion(%q), kind=kLoop, calls=%c4
}

ENTRY %main.10 (a: bf16[2,8]) -> bf16[2,8] {
  %while.11 = (s32[], bf16[2,8]{1,0}) while(%t), condition=%cond.1, body=%decode_body, metadata={op_name="jit(fused)/rollout/while"}, backend_config={"known_trip_count":{"n":"31"}}
  %while.12 = (s32[], f32[2]{0}) while(%u), condition=%cond.2, body=%update_body, metadata={op_name="jit(fused)/update/while"}, backend_config={"known_trip_count":{"n":"4"}}
  %while.15 = (s32[], s32[4]{0}) while(%w), condition=%cond.3, body=%ref_body, metadata={op_name="jit(fused)/rollout/while"}, backend_config={"known_trip_count":{"n":"7"}}
  %all-gather-start.18 = (bf16[4,8]{1,0}, bf16[8,8]{1,0}) all-gather-start(%y), dimensions={0}
  ROOT %gte.13 = bf16[2,8]{1,0} get-tuple-element(%while.11), index=1
}
"""  # noqa: E501  (an optimised XLA:GPU module's lines as XLA prints them)


def test_a_decode_loop_lists_the_kernels_its_body_runs_each_step():
    """xla_profile.decode_loops (experiments/aot_compile.py's inventory): only the rollout's
    while that runs the model's decode step (not the update's, nor another rollout loop),
    with XLA's trip count; its body's kernels, not its parameters, tuple elements,
    bitcasts and constants; each with its layer (from ``blocks_<i>``), or None for an
    unnamed kernel (which takes the while's own name)."""
    (loop,) = P.decode_loops(P.parse_hlo(LOOPS_HLO))
    assert loop["name"] == "while.11" and loop["trip"] == 31
    names = [k[0] for k in loop["kernels"]]
    assert names == ["loop_convert_fusion.2", "gemm_fusion_dot.3", "pallas_call.4",
                     "triton_softmax.7"]  # fmt: skip
    assert [k[2] for k in loop["kernels"]] == [0, 0, 1, None]
    assert loop["kernels"][1][3] == "rollout/Transformer.decode/blocks_*/qkv/dot_general"
    assert loop["kernels"][3][3] == "rollout/while"


def test_collectives_count_once_per_run_of_their_computation():
    """hlo_collectives.collectives: an asynchronous all-reduce in a 4-step loop runs 4 times
    (counted by its start, not its done), 4 KiB each; an all-gather outside any loop once,
    its larger side (the gathered [8, 8] bf16) 128 bytes."""
    got = C.collectives(P.parse_hlo(LOOPS_HLO))
    assert got == {
        "all-reduce": {"count": 4, "bytes": 4 * 4096},
        "all-gather": {"count": 1, "bytes": 128},
    }


def test_a_combined_collective_counts_every_array_it_moves():
    """hlo_collectives.result_bytes: XLA combines collectives into one over a tuple (a TPU's
    gradient all-reduces, for instance), whose arrays all move; an asynchronous all-gather's
    shape pairs its operands with its results, of which only the results count (a
    reduce-scatter's as well: its operands are whole, its results the shares); layouts'
    commas and parentheses are not tuple separators."""
    combined = "(f32[768]{0:T(1024)}, bf16[3072,768]{1,0:T(8,128)(2,1)S(1)})"
    assert C.result_bytes("all-reduce", combined) == 768 * 4 + 3072 * 768 * 2
    start = "((bf16[4,8]{1,0:T(8,128)(2,1)}, f32[2]{0}), (bf16[8,8]{1,0}, f32[4]{0}), u32[])"
    assert C.tuple_elements(start)[1] == "(bf16[8,8]{1,0}, f32[4]{0})"
    assert C.result_bytes("all-gather-start", start) == 8 * 8 * 2 + 4 * 4
    assert C.result_bytes("all-gather", "bf16[8,8]{1,0}") == 128
    # XLA:GPU's asynchronous reduce-scatter and all-to-all pair them too (they counted twice
    # the bytes, and 9 times a reduce-scatter's share over 8 devices)
    scatter = "((bf16[2304,768]{1,0}, f32[384,768]{0,1}), (bf16[288,768]{1,0}, f32[384,96]{0,1}))"
    assert C.result_bytes("reduce-scatter-start", scatter) == 288 * 768 * 2 + 384 * 96 * 4
    assert C.result_bytes(
        "all-to-all-start", "((bf16[8,512,288]{2,1,0}), bf16[8,512,288]{2,1,0})"
    ) == (8 * 512 * 288 * 2)


# XLA:TPU's whiles carry no known_trip_count: a scan's is read from its condition
TPU_LOOPS_HLO = """
%cond.1 (c: (s32[], bf16[2,8])) -> pred[] {
  %c = (s32[], bf16[2,8]) parameter(0)
  %constant.1 = s32[]{:T(128)} constant(31)
  %gte.2 = s32[]{:T(128)} get-tuple-element(%c), index=0
  ROOT %lt.3 = pred[]{:T(512)} compare(%gte.2, %constant.1), direction=LT
}

%cond.2 (d: (s32[], f32[2])) -> pred[] {
  %d = (s32[], f32[2]) parameter(0)
  %constant.4 = s32[]{:T(128)} constant(5)
  %gte.5 = s32[]{:T(128)} get-tuple-element(%d), index=0
  ROOT %gt.6 = pred[]{:T(512)} compare(%gte.5, %constant.4), direction=GT
}

%inner (x: bf16[2,8]) -> bf16[4,8] {
  %x = bf16[2,8]{1,0} parameter(0)
  ROOT %all-gather.7 = bf16[4,8]{1,0} all-gather(%x), dimensions={0}
}

%decode_body (p: (s32[], bf16[2,8])) -> (s32[], bf16[2,8]) {
  %p = (s32[], bf16[2,8]) parameter(0)
  %gte.8 = bf16[2,8]{1,0} get-tuple-element(%p), index=1
  %call.9 = bf16[4,8]{1,0} call(%gte.8), to_apply=%inner, metadata={op_name="jit(fused)/rollout/while/body/Transformer.decode/blocks_0/qkv/dot_general"}
  ROOT %tuple.10 = (s32[], bf16[2,8]) tuple(%gte.8)
}

%update_body (q: (s32[], f32[2])) -> (s32[], f32[2]) {
  %q = (s32[], f32[2]) parameter(0)
  %all-reduce.11 = f32[1024]{0} all-reduce(%q), replica_groups={{0,1}}, to_apply=%add
  ROOT %tuple.12 = (s32[], f32[2]) tuple(%q)
}

ENTRY %main.13 (a: bf16[2,8]) -> bf16[2,8] {
  %while.14 = (s32[], bf16[2,8]{1,0}) while(%t), condition=%cond.1, body=%decode_body, metadata={op_name="jit(fused)/rollout/while"}
  %while.15 = (s32[], f32[2]{0}) while(%u), condition=%cond.2, body=%update_body, metadata={op_name="jit(fused)/update/while"}
}
"""  # noqa: E501


def test_a_scans_trip_count_is_read_from_its_condition_where_xla_names_none():
    """xla_profile.scan_trip: ``counter < 31`` with one constant is a scan of 31 steps; a
    condition of any other form (here ``counter > 5``) gives no count, and its loop counts
    once. The decode loop's all-gather, in a computation its body calls, then runs 31 times
    ([4, 8] bf16 gathered: 64 bytes each); ``within`` keeps only the decode loop's."""
    instrs = P.parse_hlo(TPU_LOOPS_HLO)
    assert instrs["while.14"]["trip"] == 31 and instrs["while.15"]["trip"] is None
    (loop,) = P.decode_loops(instrs)
    assert loop["name"] == "while.14" and loop["trip"] == 31
    assert C.collectives(instrs) == {
        "all-gather": {"count": 31, "bytes": 31 * 64},
        "all-reduce": {"count": 1, "bytes": 4096},
    }
    assert C.collectives(instrs, within=["while.14"]) == {
        "all-gather": {"count": 31, "bytes": 31 * 64}
    }
    assert C.collectives(instrs, within=[]) == {}


def test_the_rollouts_scan_is_a_decode_loop_on_a_cpu_too(profiled):
    """The small program's scan, compiled here: one loop of LOOP steps, whose body runs both
    batched matmuls."""
    instrs, _, _ = profiled
    (loop,) = P.decode_loops(instrs)
    assert loop["trip"] == LOOP
    shapes = {k[4].split("{")[0] for k in loop["kernels"] if k[1] == "batched matmul"}
    assert shapes == {"f32[16,8,24]", "f32[16,8,32]"}


def test_one_op_sums_over_its_layers_and_loop_segments():
    """by_op: the same model op in every layer and in each decode segment's loop body is one
    row (its instructions counted), kept apart by kind and stage, costliest first; ``top``
    rows of each stage, so a stage whose ops all cost less than another's keeps its own."""
    values = "jit(fused)/rollout/while/body/eval_jaxpr/Transformer.decode/blocks_{}/bghts,bghsd->bgthd/dot_general"  # noqa: E501
    assert P.source_op(values.format(11)) == (
        "rollout/Transformer.decode/blocks_*/bghts,bghsd->bgthd/dot_general"
    )
    info = lambda op, body: dict(shape="f32[2]", opcode="fusion", op_name=op, body=body,
                                 batched=False, target="")  # fmt: skip
    instrs = {
        "input_reduce_fusion.1": info(values.format(0), ["multiply", "reduce"]),
        "input_reduce_fusion.2": info(values.format(1), ["multiply", "reduce"]),
        "input_reduce_fusion.3": info(values.format(1).replace("eval_jaxpr/", ""), ["reduce"]),
        "loop_add_fusion.4": info("jit(fused)/update/optimizer/add", ["add"]),
        "loop_exp_fusion.5": info(values.format(0).replace("bghts", "exp"), ["exponential"]),
    }
    times = {"input_reduce_fusion.1": (2.0, 64), "input_reduce_fusion.2": (3.0, 64),
             "input_reduce_fusion.3": (1.5, 32), "loop_add_fusion.4": (4.0, 1),
             "loop_exp_fusion.5": (5.0, 64)}  # fmt: skip
    # top=1: the decode loop's second op (5.0) goes, the optimizer's only one (4.0) stays
    res = P.summarise(instrs, (times, {"events_per_step": 0}), 1e-2, top=1)
    assert res["by_op"] == [
        dict(op=P.source_op(values.format(0)), kind="reduction", stage="rollout: decode loop",
             thunk_ms=6.5, instructions=3),
        dict(op="update/optimizer/add", kind="elementwise", stage="update: optimizer",
             thunk_ms=4.0, instructions=1),
    ]  # fmt: skip


def test_the_script_profiles_the_step_on_the_configs_mesh(tmp_path, shakespeare_path, monkeypatch):
    """``--config.mesh.data=2`` on 2 (fake) devices profiles the 2-device program the trainer
    runs (the HLO module partitioned in 2), not a 1-device one over the whole batch, and its
    matmul FLOPs are the same step's as counted on one device: the member shard_map's body
    counts once per member block, not once per device. A real subprocess (its own devices)."""
    from flop_count import matmul_flops_of
    from measure import build_step

    from grpo_jax.configs.shakespeare import get_config

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "GRPO_JAX_DATA": str(shakespeare_path), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}  # fmt: skip
    cmd = [sys.executable, "experiments/profile_step.py",
           "--config=configs/shakespeare.py:tiny,sampled", "--config.mesh.data=2", "--steps=1",
           "--warmup=0", "--hlo", "--name=p", f"--out_dir={tmp_path}"]  # fmt: skip
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((tmp_path / "p.json").read_text())
    assert res["device"] == "2 x cpu"
    assert "num_partitions=2" in (tmp_path / "p.hlo.txt").read_text().split("\n", 1)[0]

    monkeypatch.setenv("GRPO_JAX_DATA", str(shakespeare_path))
    _, step, _, state, inputs, _, _ = build_step(get_config("tiny,sampled"), on_mesh=False)
    want = matmul_flops_of(jax.make_jaxpr(step.fused)(state, inputs).jaxpr)
    got = sum(res["matmul_gflop_per_step"].values()) * 1e9
    assert got == pytest.approx(want, rel=1e-9) and want > 0
