"""The cross-device collectives in an XLA module parsed by xla_profile.parse_hlo: how many
one execution runs, loops counted by their trip counts, and the bytes they move, per kind
(experiments/aot_compile.py's report; tests/_sharding_check.py). No flags, no device."""

import collections
import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_DTYPE_BYTES |= {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def array_bytes(shape: str) -> int:
    """The bytes of every array in an HLO shape, summed (a tuple's elements)."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape):
        n = _DTYPE_BYTES.get(dtype, 0)
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n
    return total


def tuple_elements(shape: str) -> list:
    """A tuple shape's top-level elements as text (a non-tuple: itself alone); layouts'
    commas and parentheses stay inside their element."""
    if not shape.startswith("("):
        return [shape]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or depth == 0:
            parts.append(shape[start:i].strip())
            start = i + 1
        if depth == 0:
            break
    return parts


# asynchronous starts whose shape is (operands, results, context...)
_IN_OUT_STARTS = {
    "all-gather-start",
    "all-to-all-start",
    "collective-permute-start",
    "reduce-scatter-start",
}


def result_bytes(opcode: str, shape: str) -> int:
    """The bytes of a collective's result on each device: every array of a combined
    collective (XLA merges several into one, a tuple) summed; of an asynchronous start whose
    shape pairs its operands with its results, the results."""
    if opcode in _IN_OUT_STARTS:
        shape = tuple_elements(shape)[1]
    return array_bytes(shape)


def runs_per_execution(instrs: dict) -> dict:
    """{computation: how many times one execution of the module runs it}: 1 for the entry,
    its callers' runs for a called one, times XLA's trip count for a while's body (1 where
    XLA knows none). A conditional's branches each count as taken (an upper bound)."""
    callers = collections.defaultdict(list)
    for name, info in instrs.items():
        for callee in info["calls"]:
            callers[callee].append(name)
    runs = {}

    def of(comp: str) -> int:
        if comp not in runs:
            runs[comp] = 0  # a cycle cannot occur in HLO; this only guards the recursion
            total = 0 if callers[comp] else 1
            for caller in callers[comp]:
                info = instrs[caller]
                trip = (info["trip"] or 1) if comp == info["loop_body"] else 1
                total += of(info["comp"]) * trip
            runs[comp] = total
        return runs[comp]

    for info in instrs.values():
        of(info["comp"])
    return runs


def collectives(instrs: dict, within: list | None = None) -> dict:
    """{kind: {"count", "bytes"}} of the cross-device collectives one execution runs (each
    asynchronous pair once, by its start), loops counted by their trip counts; "bytes" sums
    their results' bytes (result_bytes: an all-gather's gathered array, a reduce-scatter's
    share, a combined all-reduce's every array).
    ``within``: only those the given whiles' bodies run (decode_loops' "name"s), with what
    they call."""
    runs = runs_per_execution(instrs)
    comps = None if within is None else nested({instrs[w]["loop_body"] for w in within}, instrs)
    out = {}
    for info in instrs.values():
        kind = info["opcode"].removesuffix("-start")
        if kind in COLLECTIVES and (comps is None or info["comp"] in comps):
            n = runs[info["comp"]]
            row = out.setdefault(kind, {"count": 0, "bytes": 0})
            row["count"] += n
            row["bytes"] += n * result_bytes(info["opcode"], info["shape"])
    return out


def nested(comps: set, instrs: dict) -> set:
    """``comps`` and every computation their instructions call, transitively."""
    calls = collections.defaultdict(set)
    for info in instrs.values():
        calls[info["comp"]].update(info["calls"])
    todo, seen = list(comps), set(comps)
    while todo:
        for callee in calls[todo.pop()] - seen:
            seen.add(callee)
            todo.append(callee)
    return seen
