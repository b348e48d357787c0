"""Config documentation read from the config files' source (grpo_jax/config_doc.py): every
field of every packaged config, in every variant, has a comment; the listing shows each field's
value; the comment parser takes trailing comments, comment lines above, and shared blocks."""

import importlib
import subprocess
import sys
import textwrap

import pytest

from grpo_jax import config_blocks, config_doc


def _variants(name):
    module = importlib.import_module(f"grpo_jax.configs.{name}")
    return ("", *module.VARIANTS)


@pytest.mark.parametrize("name", config_blocks.config_names())
def test_every_field_of_every_variant_has_a_comment(name):
    comments = config_doc.field_comments(config_blocks.config_path(name))
    for variant in _variants(name):
        config = config_blocks.load_config(name, variant)
        missing = [field for field, _ in config_doc.leaves(config) if not comments.get(field)]
        assert not missing, f"{name}:{variant} fields without a comment: {missing}"


def test_a_get_config_without_an_argument_loads(tmp_path):
    """The plain ml_collections ``def get_config():`` is called without one (it was refused:
    "get_config() takes 0 positional arguments but 1 was given"); a variant given to it is
    one line naming the fix."""
    path = tmp_path / "plain.py"
    path.write_text(
        "from grpo_jax.configs import toy_bandit\n\n"
        "def get_config():\n    return toy_bandit.get_config('tiny')\n"
    )
    config = config_blocks.load_config(str(path), **{"group.size": 3})
    assert config.group.size == 3
    assert (
        config.to_dict()
        == config_blocks.load_config("toy_bandit", "tiny", **{"group.size": 3}).to_dict()
    )
    with pytest.raises(
        ValueError, match=r"get_config\(\) takes no variant, got 'tiny'; drop ':tiny'"
    ):
        config_blocks.load_config(f"{path}:tiny")


def test_listing_shows_value_and_comment_of_each_field():
    config = config_blocks.load_config("shakespeare", "sampled", **{"group.size": 7})
    text = config_doc.describe(config, config_blocks.config_path("shakespeare"))
    lines = {line.split(" = ")[0]: line for line in text.splitlines() if " = " in line}
    assert len(lines) == len(list(config_doc.leaves(config)))
    assert lines["group.size"].startswith("group.size = 7 ")
    assert "# G for sampled groups" in lines["group.size"]
    assert "group.mode = 'sampled'" in lines["group.mode"]
    # A field of a shared block (config_blocks.mesh_block) takes the block's comment.
    assert "# devices on the member axis" in lines["mesh.member"]


def test_a_checkout_config_path_documents_the_packaged_configs_fields():
    """configs/<name>.py in a checkout only re-exports the packaged get_config: its comments
    are the packaged file's (the shim itself has none: every field read "no comment")."""
    from pathlib import Path

    shim = Path(__file__).resolve().parents[1] / "configs" / "shakespeare.py"
    assert config_doc.defining_file(shim) == config_blocks.config_path("shakespeare")
    packaged = config_doc.field_comments(config_blocks.config_path("shakespeare"))
    assert config_doc.field_comments(shim) == packaged and packaged["group.size"]


def test_comment_parser_on_a_hand_written_file(tmp_path):
    source = textwrap.dedent(
        """
        from grpo_jax import config_blocks as blocks

        def get_config(arg=None):
            c = Dict()
            c.a = 1  # trailing
            # above, line one
            # line two
            c.b = 2
            c.mesh = blocks.mesh_block()
            c.group = Dict()
            blocks.cheap_group_fields(c.group, num_classes=8)
            if arg:
                c.a = 3
                c.group.num_classes = 32  # the variant's own value: not the field's comment
                c.only_in_variant = 5  # a variant's field
            c.uncommented = 4
            return c
        """
    )
    path = tmp_path / "cfg.py"
    path.write_text(source)
    comments = config_doc.field_comments(path)
    assert comments["a"] == "trailing"
    assert comments["b"] == "above, line one line two"
    assert comments["mesh.data"].startswith("devices on the data axis")
    assert comments["group.num_classes"].startswith("hierarchical, class_kind=blocks")
    assert comments["only_in_variant"] == "a variant's field"
    assert comments["uncommented"] == ""


@pytest.mark.parametrize("how", ["--help", "--mode=print_config"])
def test_cli_lists_every_field_with_overrides_and_touches_nothing(how, tmp_path):
    args = ["--config=toy_bandit:tiny", "--config.group.size=3", f"--workdir={tmp_path}/w", how]
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_jax.main", *args], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    config = config_blocks.load_config("toy_bandit", "tiny", **{"group.size": 3})
    listed = {line.split(" = ")[0] for line in proc.stdout.splitlines() if " = " in line}
    assert {field for field, _ in config_doc.leaves(config)} <= listed
    assert "group.size = 3 " in proc.stdout
    assert ("--workdir: Where" in proc.stdout) == (how == "--help")  # the flags' help
    assert not (tmp_path / "w").exists()
