"""Every field of a config with its value and the comment it has in the config file.

``grpo-jax --config=NAME --mode=print_config`` prints this. The comments are read from the
source, so they cannot drift from the file: a field's comment is the trailing ``# ...`` of the
line that assigns it, or the comment lines directly above that line (the config files use both,
the second for comments too long for one line). Fields that a shared block of
``config_blocks`` builds (``c.mesh = blocks.mesh_block()``) or adds to a block
(``blocks.cheap_group_fields(c.group)``) take their comments from that block's function.
``tests/test_config_doc.py`` holds every packaged config to a comment on every field.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import tokenize
from pathlib import Path

from grpo_jax import config_blocks


def _comments_by_line(source: str) -> dict[int, str]:
    """{line number: comment text without '#'} for every comment in ``source``."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _attribute_path(node) -> list[str] | None:
    """``c.group.size`` → ["group", "size"] (the root variable dropped); None for other targets."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return names[::-1] if isinstance(node, ast.Name) and names else None


def _comment_for(node, lines: list[str], comments: dict[int, str]) -> str:
    """The assignment's trailing comment, else the run of comment-only lines right above it."""
    if node.end_lineno in comments:
        return comments[node.end_lineno]
    above, line = [], node.lineno - 1
    while line >= 1 and lines[line - 1].strip().startswith("#"):
        above.append(comments[line])
        line -= 1
    return " ".join(reversed(above))


def _in_branches(tree) -> set[int]:
    """ids of the nodes under an ``if``: a variant's settings, not the field's own."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            for stmt in node.body + node.orelse:
                inside.update(id(n) for n in ast.walk(stmt))
    return inside


def _parsed(source: str):
    """(the source, its tree, the ids of the nodes under an ``if``): what both readers below
    take, so that a config file is parsed once."""
    tree = ast.parse(source)
    return source, tree, _in_branches(tree)


def _assignments(parsed):
    """(function, dotted path, comment, the assigned value node, under an ``if``) for every
    ``x.a.b = ...`` in the parsed source's top-level functions."""
    source, tree, branches = parsed
    lines, comments = source.splitlines(), _comments_by_line(source)
    for func in tree.body:
        if not isinstance(func, ast.FunctionDef):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                path = _attribute_path(node.targets[0])
                if path:
                    comment = _comment_for(node, lines, comments)
                    yield func.name, ".".join(path), comment, node.value, id(node) in branches


def defining_file(config_file: str | Path) -> Path:
    """The file whose ``get_config`` the config file runs: itself, or the module it imports
    ``get_config`` from (the checkout's ``configs/*.py`` re-export the packaged configs)."""
    for node in ast.parse(Path(config_file).read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if any(alias.name == "get_config" for alias in node.names):
                spec = importlib.util.find_spec(node.module)
                if spec is not None and spec.origin:
                    return Path(spec.origin)
    return Path(config_file)


def field_comments(config_file: str | Path) -> dict[str, str]:
    """{dotted field: comment} for a config file, blocks included. The unconditional settings'
    comments come first, a variant's (under an ``if``) only fill the gaps: its comment speaks
    of its own value. Within each, the first non-empty comment of a field wins (variants
    re-assign fields without repeating the comment)."""
    parsed = _parsed(defining_file(config_file).read_text())
    block_fields: dict[str, dict[str, str]] = {}
    for func, path, comment, _, _ in _assignments(
        _parsed(Path(config_blocks.__file__).read_text())
    ):
        block_fields.setdefault(func, {}).setdefault(path, comment)
    assignments, calls = list(_assignments(parsed)), list(_block_calls(parsed))
    out: dict[str, str] = {}
    for in_variant in (False, True):
        for _, path, comment, value, branch in assignments:
            if branch != in_variant:
                continue
            if comment and not out.get(path):
                out[path] = comment
            out.setdefault(path, "")
            called = value.func if isinstance(value, ast.Call) else None
            if isinstance(called, ast.Attribute) and called.attr in block_fields:
                for field, field_comment in block_fields[called.attr].items():
                    out.setdefault(f"{path}.{field}", field_comment)
        for path, func, branch in calls:
            if branch != in_variant:
                continue
            for field, field_comment in block_fields.get(func, {}).items():
                # a variant's bare re-assignment (no comment) keeps the block's comment
                out[f"{path}.{field}"] = out.get(f"{path}.{field}") or field_comment
    return out


def _block_calls(parsed):
    """(dotted path, function, under an ``if``) of every ``blocks.f(c.a.b, ...)`` statement: a
    block function that adds fields to an existing block."""
    _, tree, branches = parsed
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            call = node.value
            path = _attribute_path(call.args[0]) if call.args else None
            if isinstance(call.func, ast.Attribute) and path:
                yield ".".join(path), call.func.attr, id(node) in branches


def leaves(config, prefix: str = ""):
    """(dotted name, value) for every leaf field of a ConfigDict, in insertion order."""
    for key, value in config.items():
        name = f"{prefix}{key}"
        if hasattr(value, "items"):
            yield from leaves(value, name + ".")
        else:
            yield name, value


def describe(config, config_file: str | Path) -> str:
    """The printable listing: ``name = value  # comment``, one field a line, grouped by block."""
    comments = field_comments(config_file)
    # Top-level fields (task, seed, ...) first, then one block after another.
    rows = sorted(leaves(config), key=lambda row: "." in row[0])
    width = max(len(f"{name} = {value!r}") for name, value in rows)
    out, block = [], None
    for name, value in rows:
        if name.split(".")[0] != block and "." in name:
            block = name.split(".")[0]
            out.append(f"\n[{block}]  {comments.get(block, '')}".rstrip())
        text = f"{name} = {value!r}"
        comment = comments.get(name, "(no comment in the config file)")
        out.append(f"{text.ljust(width)}  # {comment}")
    return "\n".join(out).lstrip("\n")
