"""Tiny Shakespeare: fixed-length token windows, fixed-horizon completions.

Tokens are chars (``data.tokenizer=char``, the default) or a BPE vocabulary of
``data.vocab_size`` tokens trained on the train split (``bpe``, grpo_jax/bpe.py; kept as
``tokenizer.json`` in the workdir). A prompt is ``data.context_len`` tokens of the train split;
its completion runs for exactly ``data.horizon`` tokens (no EOS) and is rewarded per token
against the true continuation's tokens (grpo_jax/rewards.py terms, e.g. ``match_partial``),
with an n-gram (over token ids) or frozen-policy reference. Evaluation scores held-out windows
(next-char accuracy and bits per char, comparable across tokenizers, beside the n-gram
baselines on the same windows); the host hook draws the per-first-token heatmap of exhaustive
groups. ``--mode=pretrain`` trains the same model supervised (next token).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import bpe, candidates, engine, groups, pretrain, reference, rewards, sharding
from grpo_jax import data as data_lib
from grpo_jax import evaluate as eval_lib
from grpo_jax.metric_writers import truncate_rows
from grpo_jax.model import init_params, make_model
from grpo_jax.policy import Reference, TokenPrompts, policy_reference, transformer_policy
from grpo_jax.specs import EngineSpec, ModelSpec, OptimSpec
from grpo_jax.task import Hooks, Task
from grpo_jax.train_state import StepInputs, init_state, make_optimizer
from grpo_jax.validate import boolean, choice, integer, number, require

REFERENCE_KINDS = ("ngram", "policy", "none")
TOKENIZERS = ("char", "bpe")


def validate_tokenizer(d) -> str:
    """data.tokenizer and data.vocab_size (absent in older configs: chars)."""
    kind = choice("data.tokenizer", d.get("tokenizer", "char"), TOKENIZERS)
    size = integer("data.vocab_size", d.get("vocab_size", 0), 0 if kind == "char" else 1)
    require(
        kind == "bpe" or size == 0,
        "data.vocab_size",
        size,
        "must be 0 with data.tokenizer='char' (the corpus's characters are the vocabulary); "
        "set data.tokenizer='bpe' (variant :bpe<N>) for a subword vocabulary",
    )
    return kind


def validate(config, mode: str) -> int:
    """The task's own settings (the engine's are specs.EngineSpec's); returns max_len."""
    if mode == "train_judge":
        raise ValueError("task=shakespeare has no judge; --mode=train_judge is for task=fill_in")
    d, m = config.data, config.model
    validate_tokenizer(d)
    c = integer("data.context_len", d.context_len, 1)
    h = integer("data.horizon", d.horizon, 1)
    max_len = integer("model.max_len", m.max_len) or c + h
    require(
        c + h <= max_len,
        "model.max_len",
        max_len,
        f"must hold data.context_len + data.horizon = {c + h}; raise model.max_len or "
        "shorten the window",
    )
    if mode == "pretrain":
        seq = integer("pretrain.seq_len", config.pretrain.seq_len)
        require(seq <= max_len, "pretrain.seq_len", seq, f"must be <= model.max_len={max_len}")
    kind = choice("reference.kind", config.reference.kind, REFERENCE_KINDS)
    if kind == "ngram":
        integer("reference.ngram_order", config.reference.ngram_order, 1)
        number("reference.smoothing", config.reference.smoothing, 0.0, open_low=True)
    r = config.reward
    number("reward.partial_credit", r.get("partial_credit", 0.0), 0.0, 1.0)
    integer("reward.partial_topk", r.get("partial_topk", 1), 1)
    boolean("reward.per_token", r.get("per_token", False))
    discount = config.reward.get("discount", 1.0)
    ok = isinstance(discount, int | float) and 0.0 <= discount <= 1.0
    require(ok, "reward.discount", discount, "must lie in [0, 1]: a discount 0 <= γ <= 1")
    if rewards.needs_reference(config.reward) and kind == "none":
        raise ValueError(
            f"reward.terms={config.reward.terms!r} needs a reference model; "
            "set reference.kind=ngram|policy or use reward.terms=match"
        )
    if config.group.mode == "guided" and config.group.guide == "reference" and kind == "none":
        raise ValueError("group.guide=reference needs reference.kind=ngram|policy")
    return max_len


def make_reference(kind, ref_cfg, corpus, policy, initial_params, temperature):
    """(Reference or None, its state). ``policy`` freezes ``initial_params`` (the policy GRPO
    starts from, i.e. after init_from), so a resumed run rebuilds the same reference; it is
    read at the sampling ``temperature``, as the policy (policy_reference). An n-gram is an
    outside language model and is read as it is, at any temperature."""
    if kind == "none":
        return None, None
    if kind == "ngram":
        lm = reference.fit_ngram(
            corpus.train, corpus.vocab.size, ref_cfg.ngram_order, ref_cfg.smoothing
        )
        return Reference(
            lambda lm_, prompts: (reference.ngram_logprobs(lm_, prompts.tokens)[:, -1], None),
            lambda lm_, _, prompts, tokens: reference.rollout_ref_logprobs(
                lm_, prompts.tokens, tokens
            ),
        ), lm
    # a copy: the trainer donates the state, whose params start as these very buffers
    return policy_reference(policy, temperature), jax.tree.map(jnp.copy, initial_params)


def load_corpus(data_config, workdir=None) -> data_lib.Corpus:
    """Char ids, or BPE ids with the tokenizer kept in ``workdir`` (a resume) or a new one
    trained on the train split."""
    if data_config.get("tokenizer", "char") == "bpe":
        return bpe.load_corpus(data_config, workdir)
    return data_lib.load_corpus(data_config)


def ngram_baselines(corpus, orders, context, target, token_chars) -> dict:
    """n-grams fitted on the train split, scored on exactly the eval windows, logged beside the
    policy's figures so that "above the bigram" compares identical predictions: next-char
    accuracy (for subwords: first chars, plus next-token accuracy)."""
    out = {}
    for k in orders:
        lm = reference.fit_ngram(corpus.train, corpus.vocab.size, k)
        pred = reference.window_predictions(lm, context, target)
        if token_chars is None:
            out[f"eval/ngram{k}_next_char_accuracy"] = float((pred == target).mean())
            continue
        first = token_chars.first_char
        out[f"eval/ngram{k}_next_char_accuracy"] = float((first[pred] == first[target]).mean())
        out[f"eval/ngram{k}_next_token_accuracy"] = float((pred == target).mean())
    return out


def make_evaluate(config, model, corpus, token_chars):
    """params -> (scalars, texts) on the held-out windows of the val split."""
    c, h = config.data.context_len, config.data.horizon
    ev_ctx, ev_tgt = data_lib.eval_windows(corpus.val, config.eval.num_windows, c, h)
    ev_bs = min(config.eval.batch_size, len(ev_ctx))  # >= 1: run_spec.ReportSpec
    eval_core = jax.jit(
        eval_lib.make_eval_fn(model, c, h, ev_bs, tuple(config.eval.pass_k), token_chars)
    )
    ev_ctx_d, ev_tgt_d = jnp.asarray(ev_ctx), jnp.asarray(ev_tgt)
    orders = config.eval.get("ngram_baselines", ())
    baselines = ngram_baselines(corpus, orders, ev_ctx, ev_tgt, token_chars)

    def evaluate(params):
        res = eval_core(params, ev_ctx_d, ev_tgt_d)
        num = config.eval.num_samples
        scalars, best, text = eval_lib.summarize(res, corpus.vocab, ev_ctx, num)
        return {**scalars, **baselines}, {"samples": text, "summary": f"best_char={best!r}"}

    return evaluate


def char_stats_hooks(every: int, labels) -> Hooks:
    """Accumulate exhaustive groups' per-first-token return and best-share every step; write
    char_stats.jsonl (``labels``: the tokens' strings) every ``every`` steps and draw
    char_heatmap.png at the end. A row averages steps ``first_step``..``step``: the window's
    steps before a resume are not in the checkpoint, so a row after a resume inside its window
    averages fewer steps, and says so."""
    acc = {"sum": None, "n": 0, "first": 0, "resumed": False}

    def on_step(workdir, step, metrics):
        if "first_token/reward" not in metrics:
            return
        path = workdir / "char_stats.jsonl"
        if not acc["resumed"] and path.exists():  # rows past a resume's step: logged again
            truncate_rows(path, step - 1)
        acc["resumed"] = True
        cm = np.stack([metrics["first_token/reward"], metrics["first_token/best"]])
        if acc["sum"] is None:
            acc["sum"], acc["first"] = cm, int(step)
        else:
            acc["sum"] = acc["sum"] + cm
        acc["n"] += 1
        if step % every == 0:
            stats = acc["sum"] / acc["n"]
            row = {
                "step": int(step),
                "first_step": acc["first"],
                "chars": labels,
                "reward": [round(float(x), 5) for x in stats[0]],
                "best": [round(float(x), 5) for x in stats[1]],
            }
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            acc["sum"], acc["n"] = None, 0

    def on_end(workdir):
        if (workdir / "char_stats.jsonl").exists():
            from grpo_jax import plots

            plots.char_heatmap(workdir / "char_stats.jsonl", workdir / "char_heatmap.png")

    return Hooks(on_step, on_end) if every else Hooks()


def build(config, mode: str = "train", workdir=None) -> Task:
    max_len = validate(config, mode)
    pretraining = mode == "pretrain"
    espec = None if pretraining else EngineSpec.from_config(config)
    mspec = ModelSpec.from_config(config.model)
    corpus = load_corpus(config.data, workdir)
    vocab = corpus.vocab
    subword = isinstance(vocab, bpe.BpeTokenizer)
    token_chars = eval_lib.TokenChars(vocab.first_char, vocab.num_chars) if subword else None
    classes = None
    if espec is not None:
        espec.group.check_vocab(vocab.size, config.data.horizon)
        classes = candidates.task_classes(
            espec.group, [vocab.decode([i]) for i in range(vocab.size)]
        )
    model = make_model(mspec, vocab.size, max_len)
    c, h = config.data.context_len, config.data.horizon
    evaluate = make_evaluate(config, model, corpus, token_chars)
    train_tokens = jnp.asarray(corpus.train)
    num_steps = config.pretrain.num_steps if pretraining else config.train.num_steps
    optim = OptimSpec.from_config(
        config.optim,
        config.pretrain.learning_rate if pretraining else None,
        "pretrain.learning_rate" if pretraining else "optim.learning_rate",
    )
    # GRPO steps make grpo.num_iterations optimizer updates each: the schedule spans them all
    mu = 1 if pretraining else espec.objective.num_iterations
    tx, schedule = make_optimizer(optim, num_steps, updates_per_step=mu)
    b = config.train.batch_size

    def sample_prompts(key, tokens):
        context, target = data_lib.sample_windows(key, tokens, b, c, h)
        return TokenPrompts(context, None, {"target": target})

    def build_step(initial_params, mesh=None):
        if pretraining:
            step = pretrain.make_pretrain_step(
                config, model, tx, schedule, sharding.step_hooks(mesh).shard_batch
            )
            return step, StepInputs(train_tokens, None)
        sp = espec.group.sampling
        policy = transformer_policy(model, sp, h)
        ref, ref_state = make_reference(
            config.reference.kind, config.reference, corpus, policy, initial_params, sp.temperature
        )
        step = engine.make_grpo_step(
            espec,
            policy,
            ref,
            sample_prompts,
            rewards.char_terms(config.reward),
            tx,
            schedule,
            # members over the member axis, prompts over data
            hooks=sharding.step_hooks(mesh, config),
            reward_discount=float(config.reward.get("discount", 1.0)),
            per_token_advantages=bool(config.reward.per_token),
            token_classes=classes,
            completion_fields=("target",),
        )
        return step, StepInputs(train_tokens, ref_state)

    if pretraining:
        tokens = config.pretrain.batch_size * pretrain.seq_len(config, max_len)
    else:
        tokens = b * groups.generated_per_prompt(espec.group, vocab.size, b, h, classes)
    return Task(
        init_params=lambda key: init_params(model, key),
        make_state=lambda params: init_state(params, tx, config.seed),
        build=build_step,
        evaluate=evaluate,
        tokens_per_step=int(tokens),
        num_steps=int(num_steps),
        vocab=vocab,
        hooks=char_stats_hooks(
            int(config.logging.get("char_stats_every", 0)),
            list(vocab.pieces) if subword else vocab.chars,
        ),
        log_keys=("loss", "reward", "kl", "eval/next_char_accuracy"),
        heldout_key="eval/rollout_accuracy",
        data_sha256=corpus.sha256,
        files=((bpe.FILE_NAME, vocab.to_str()),) if subword else (),
        batch_setting="pretrain.batch_size" if pretraining else "train.batch_size",
    )
