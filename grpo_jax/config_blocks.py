"""Config pieces every task's config file shares: variant parsing and the run-plumbing blocks.

The config files in grpo_jax/configs/ keep every field that defines an experiment (data, model,
group, reward, objective, optimizer, schedule) with its own comment; the blocks here are the fields
that only say where a run executes and how it reports (mesh, logging, diagnostics, how attention
runs), documented once so that the three tasks cannot drift apart. Each block takes the values
that differ by task as arguments.
"""

import ast
import contextlib
import importlib.util
import inspect
from pathlib import Path

from ml_collections import config_dict

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def config_names():
    """The packaged configs' names (``shakespeare``, ``arithmetic``, ...)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.py") if not p.stem.startswith("_"))


def config_path(name: str) -> Path:
    """The file behind a ``--config`` value without its ``:variant``: a path to a ``.py`` file
    (from a checkout, as before) or a packaged config's name (works from an installed wheel)."""
    if name.endswith(".py") or "/" in name or "\\" in name:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(
                f"no config file {name}; give a packaged config by name "
                f"({', '.join(config_names())}) or the path of an existing .py file"
            )
        return path
    if name not in config_names():
        raise FileNotFoundError(
            f"no packaged config {name!r}; choose from {', '.join(config_names())} "
            "or give the path of a .py config file"
        )
    return CONFIG_DIR / f"{name}.py"


def resolve_config_flag(value: str) -> str:
    """``--config``'s value as config_flags wants it (``path[:variant]``): a packaged name is
    turned into its file's path, a path is checked to exist, the variant is kept."""
    name, sep, variant = value.partition(":")
    return f"{config_path(name)}{sep}{variant}"


def variant_tokens(arg, allowed, config_file):
    """Splits get_config's ``arg`` ("a,b") and rejects tokens not in ``allowed`` in one line."""
    tokens = [t.strip() for t in (arg or "").split(",") if t.strip()]
    unknown = [t for t in tokens if t not in allowed]
    if unknown:
        raise ValueError(
            f"unknown config variant {unknown[0]!r} for {config_file}; "
            f"choose from {', '.join(allowed)} (comma-separated)"
        )
    return tokens


def set_field(config, key: str, text: str):
    """config.<key> = literal(text) (a string when it is not a Python literal), creating the
    field when the config lacks it: the experiments' per-mode ``mode:key=value`` settings."""
    *parents, leaf = key.split(".")
    for p in parents:
        config = config[p]
    with contextlib.suppress(ValueError, SyntaxError):
        text = ast.literal_eval(text)
    with config.unlocked():
        config[leaf] = text


def pick_one(tokens, options, default, what):
    """The one token of ``options`` in ``tokens`` (``default`` when none); two is an error."""
    chosen = [t for t in tokens if t in options] or [default]
    if len(chosen) > 1:
        raise ValueError(f"config variants name two {what} {chosen}; pick one")
    return chosen[0]


def mesh_block():
    m = config_dict.ConfigDict()
    m.data = -1  # devices on the data axis (-1 = all remaining)
    m.member = 1  # devices on the member axis: every group's members are split over it
    m.shard_params = False  # FSDP-style: shard params/optimizer state over data
    return m


def attention_fields(m):
    """How the transformer's attention runs (model.py): the same softmax whichever is chosen,
    up to rounding."""
    # attention of the full-sequence passes (prefill, reference and training forwards):
    # shared_prefix (any device; the prompt's keys once per group) | cudnn (jax's fused flash
    # kernel on a CUDA GPU, bfloat16/float16) | xla (the cudnn path's math, any device)
    m.attention = "shared_prefix"
    # attention of the decode steps: xla (XLA's ops, any device) | pallas (one Triton kernel
    # per layer that reads only the written cache slots; a CUDA GPU, head dim a power of two)
    # | flash (jax's flash-decoding kernel, the prompt read once per prompt; a CUDA GPU, head
    # dim a power of two >= 16)
    m.decode_kernel = "xla"


def cheap_group_fields(g, max_candidates=64, num_classes=32):
    """The settings of the forced groups that cost less than V rollouts (candidates.py)."""
    g.coverage = 0.95  # pruned: candidates cover this much of the guide's probability mass
    g.max_candidates = max_candidates  # pruned: at most this many candidates (static group size)
    g.class_kind = "chars"  # hierarchical classes: chars (by first char) | blocks (id ranges)
    g.num_classes = num_classes  # hierarchical, class_kind=blocks: number of id blocks
    g.expand_classes = 1  # hierarchical: classes with the most mass whose every token is forced
    g.value_horizon = 0  # forced members run this many tokens (0 = the full horizon)
    # forced groups per rollout, at its highest-entropy positions (> 1 needs value_horizon)
    g.decision_points = 1
    # forced members' tokens after the first: position (each token's reward against the
    # members' mean there) | return (the member's return advantage, weighted by π(first token))
    g.continuation_credit = "position"


def optim_block(learning_rate, warmup_steps=0, end_lr_fraction=0.1, grad_clip=1.0, b2=0.99):
    o = config_dict.ConfigDict()
    o.learning_rate = learning_rate  # peak learning rate
    o.warmup_steps = warmup_steps  # linear warmup, then cosine decay to end_lr_fraction * peak
    o.end_lr_fraction = end_lr_fraction  # final lr as a fraction of the peak
    o.weight_decay = 0.0  # AdamW decoupled weight decay
    o.grad_clip = grad_clip  # global-norm clip (0 = off)
    o.b1 = 0.9  # Adam beta1
    o.b2 = b2  # Adam beta2
    return o


def logging_block(tensorboard=True, char_stats_every=0):
    lg = config_dict.ConfigDict()
    lg.tensorboard = tensorboard  # write TensorBoard event files to the workdir
    lg.wandb = False  # also log to Weights & Biases (if installed)
    lg.wandb_project = "grpo_jax"  # W&B project name
    lg.progress = True  # console progress bar
    # per-first-token stats cadence (char_stats.jsonl + heatmap; exhaustive Shakespeare; 0 = off)
    lg.char_stats_every = char_stats_every
    return lg


def diagnostics_block(
    kl_bound=0.1, reward_std_low=0.3, reward_std_high=2.0, patience=20, heldout_min_drop=0.005
):
    d = config_dict.ConfigDict()
    d.kl_bound = kl_bound  # warn when kl (nats per generated token) exceeds this
    d.reward_std_low = reward_std_low  # warn when the group reward std stays below ...
    d.reward_std_high = reward_std_high  # ... or above this
    d.patience = patience  # for this many consecutive logged steps
    # reward-hacking warning: reward up while a held-out metric falls by more than this
    d.heldout_min_drop = heldout_min_drop
    return d


def load_config(name: str, variant: str = "", **overrides):
    """A config file's ``get_config(variant)`` with dotted-key overrides, outside absl flags
    (tests, notebooks, experiment scripts): ``load_config("toy_bandit", "rlvr",
    **{"train.num_steps": 50})``. ``name`` is a packaged config's name (``"toy_bandit"``, or
    ``"toy_bandit:rlvr"`` with its variant) or a path to a .py file."""
    if ":" in name and not variant:
        name, variant = name.split(":", 1)
    path = config_path(name)
    spec = importlib.util.spec_from_file_location(f"_grpo_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = _called(module.get_config, variant, path)
    config.update_from_flattened_dict(overrides)
    return config


def _called(get_config, variant: str, path: Path):
    """``get_config(variant)``, or ``get_config()`` for one that takes no argument (the plain
    ml_collections form, which config_flags calls so when no variant is given)."""
    if inspect.signature(get_config).parameters:
        return get_config(variant)
    if variant:
        raise ValueError(
            f"config file {path}: get_config() takes no variant, got {variant!r}; drop "
            f"':{variant}' from --config, or give get_config an argument to read it"
        )
    return get_config()
