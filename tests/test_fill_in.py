"""Fill-in with a judge: refusal checks, judge training, frozen judge/reference, metrics."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import checkpoint as ckpt_lib
from grpo_jax import data as data_lib
from grpo_jax import judge as judge_lib
from grpo_jax import sharding, trainer
from grpo_jax.config_blocks import load_config
from grpo_jax.encoder import Encoder
from grpo_jax.engine import STEP_METRICS as TRAIN_STEP_METRICS
from grpo_jax.metric_writers import read_metrics
from grpo_jax.tasks import build_task, fill_in, fill_in_eval
from grpo_jax.train_state import TrainState

pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py

ROOT = Path(__file__).resolve().parents[1]
STEP_METRICS = TRAIN_STEP_METRICS + ("rewards/fill_accuracy/mean",)


def get_config(arg="tiny"):
    return load_config("fill_in", arg)


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory, shakespeare_path):
    """A tiny supervised generator (--mode=pretrain): the judge's "generator" negatives."""
    cfg = get_config()
    cfg.data.path = str(shakespeare_path)
    workdir = tmp_path_factory.mktemp("gen")
    trainer.train_and_evaluate(cfg, str(workdir), "pretrain")
    return workdir


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory, shakespeare_path, gen_dir):
    """A tiny judge trained by --mode=train_judge (through the common trainer), with every
    corruption kind, the generator's fills included."""
    cfg = get_config()
    cfg.data.path = str(shakespeare_path)
    cfg.judge.corruptions = ",".join(judge_lib.CORRUPTIONS)
    cfg.judge.negatives_from = str(gen_dir)
    workdir = tmp_path_factory.mktemp("judge")
    _, last = trainer.train_and_evaluate(cfg, str(workdir), "train_judge")
    assert 0.0 <= last["eval/judge_accuracy"] <= 1.0
    assert 0.0 <= last["eval/judge_pair_accuracy"] <= 1.0
    return workdir


def fill_config(shakespeare_path, judge_dir):
    cfg = get_config()
    cfg.data.path = str(shakespeare_path)
    cfg.judge.checkpoint = str(judge_dir)
    return cfg


def test_spans_are_one_contiguous_run():
    span = np.asarray(judge_lib.random_spans(jax.random.PRNGKey(0), 256, 12, 1, 3))
    lengths = span.sum(1)
    assert lengths.min() >= 1 and lengths.max() <= 3
    edges = np.abs(np.diff(np.pad(span, ((0, 0), (1, 1))), axis=1)).sum(1)
    np.testing.assert_array_equal(edges, 2)  # exactly one run of ones per row


def constant_generator(vocab=20, length=12, bias=None):
    """A tiny generator whose output ignores its input: softmax(bias) at every position."""
    gen = Encoder(vocab_size=vocab + 1, out_size=vocab, num_layers=1, d_model=16, max_len=length)
    params = gen.init(jax.random.PRNGKey(0), jnp.zeros((1, length), jnp.int32))["params"]
    params = dict(params)
    params["lm_head"] = {
        "kernel": jnp.zeros_like(params["lm_head"]["kernel"]),
        "bias": jnp.asarray(bias, jnp.float32),
    }
    return gen, params


def corruption_data(tokens, vocab=20, gen_params=None):
    t = np.asarray(tokens)
    return judge_lib.CorruptionData(
        jnp.asarray(tokens),
        judge_lib.log_unigram_of(t, vocab),
        judge_lib.log_bigram_of(t, vocab),
        gen_params,
    )


def test_corruptions_stay_inside_the_span():
    tokens = jnp.arange(200, dtype=jnp.int32) % 20
    real = data_lib.random_windows(jax.random.PRNGKey(1), tokens, 64, 12)
    span = judge_lib.random_spans(jax.random.PRNGKey(2), 64, 12, 1, 3)
    gen, gparams = constant_generator(bias=np.linspace(-1.0, 1.0, 20))
    fill = lambda k, p, w, s: judge_lib.generator_fill(k, gen, p, w, s, mask_id=20)
    fake, kind, changed = judge_lib.corrupt(
        jax.random.PRNGKey(3),
        real,
        span,
        corruption_data(tokens, gen_params=gparams),
        judge_lib.CORRUPTIONS,
        fill,
    )
    diff = np.asarray(fake != real)
    assert not diff[np.asarray(span) == 0].any()
    np.testing.assert_array_equal(diff.any(1), np.asarray(changed))
    assert set(np.asarray(kind).tolist()) == set(range(len(judge_lib.CORRUPTIONS)))
    assert 0 <= int(fake.min()) and int(fake.max()) < 20  # the mask id never leaks in


def test_bigram_corruption_follows_the_train_bigrams():
    """A corpus where c is always followed by c+1 or c+2 (mod 20): the bigram fill of a span
    takes one of those two steps from the char before it (sampled or original), both about
    equally often, and so differs from the original span in about half the rows."""
    rng = np.random.default_rng(0)
    tokens = np.cumsum(rng.integers(1, 3, 20000)) % 20
    data = corruption_data(tokens)
    real = data_lib.random_windows(jax.random.PRNGKey(1), jnp.asarray(tokens), 2048, 12)
    span = judge_lib.random_spans(jax.random.PRNGKey(2), 2048, 12, 1, 3)
    fake = np.asarray(judge_lib.bigram_fill(jax.random.PRNGKey(3), real, span, data.log_bigram))
    real, span = np.asarray(real), np.asarray(span)
    np.testing.assert_array_equal(fake[span == 0], real[span == 0])
    assert fake.min() >= 0 and fake.max() < 20
    inner = span[:, 1:] > 0  # masked positions with a char before them
    step = ((fake[:, 1:] - fake[:, :-1]) % 20)[inner]
    assert np.isin(step, (1, 2)).mean() > 0.97  # smoothing leaves ~1% elsewhere
    assert 0.4 < (step == 1).mean() < 0.6
    differs = (fake != real).any(1)
    assert 0.3 < differs.mean() < 0.9


def test_generator_negatives_come_from_the_generator_distribution():
    """Fills of a generator with fixed output logits b: the masked chars are distributed as
    softmax(b / T), the rest of the window is untouched, and the mask id never appears."""
    bias = np.array([2.0, 1.0, 0.0, -1.0, 0.5] + [-9.0] * 15, np.float32)
    gen, params = constant_generator(bias=bias)
    tokens = jnp.arange(1000, dtype=jnp.int32) % 20
    real = data_lib.random_windows(jax.random.PRNGKey(1), tokens, 4096, 12)
    span = judge_lib.random_spans(jax.random.PRNGKey(2), 4096, 12, 1, 3)
    for temp in (1.0, 0.5):
        fake = judge_lib.generator_fill(jax.random.PRNGKey(3), gen, params, real, span, 20, temp)
        fake, r, s = np.asarray(fake), np.asarray(real), np.asarray(span)
        np.testing.assert_array_equal(fake[s == 0], r[s == 0])
        freq = np.bincount(fake[s > 0], minlength=20) / (s > 0).sum()
        want = np.exp(bias / temp) / np.exp(bias / temp).sum()
        np.testing.assert_allclose(freq, want, atol=0.02)


def test_generator_fill_reads_the_masked_window():
    """The generator sees the mask token at the span (not the original chars): its fill
    equals a direct sample from generator(masked window) with the same key."""
    tokens = jnp.arange(200, dtype=jnp.int32) % 20
    gen = Encoder(vocab_size=21, out_size=20, num_layers=1, d_model=16, max_len=12)
    params = gen.init(jax.random.PRNGKey(5), jnp.zeros((1, 12), jnp.int32))["params"]
    real = data_lib.random_windows(jax.random.PRNGKey(1), tokens, 32, 12)
    span = judge_lib.random_spans(jax.random.PRNGKey(2), 32, 12, 1, 3)
    fake = judge_lib.generator_fill(jax.random.PRNGKey(3), gen, params, real, span, 20)
    masked = jnp.where(span > 0, 20, real)
    direct = jax.random.categorical(jax.random.PRNGKey(3), gen.apply({"params": params}, masked))
    np.testing.assert_array_equal(np.asarray(fake), np.where(span > 0, direct, real))


def test_corruption_names_are_validated_in_one_line(shakespeare_path, tmp_path):
    cfg = get_config()
    cfg.data.path = str(shakespeare_path)
    cfg.judge.corruptions = "random,bogus"
    with pytest.raises(ValueError, match="unknown corruption 'bogus'") as err:
        build_task(cfg, "train_judge")
    assert "\n" not in str(err.value)
    cfg.judge.corruptions = "random,generator"
    with pytest.raises(ValueError, match="needs judge.negatives_from"):
        build_task(cfg, "train_judge")
    cfg.judge.corruptions = "random,swap"
    cfg.judge.negatives_from = str(tmp_path)
    with pytest.raises(ValueError, match="lacks 'generator'"):
        build_task(cfg, "train_judge")
    cfg.judge.corruptions = "random,generator"  # a workdir with no checkpoint
    with pytest.raises(ValueError, match="judge.negatives_from") as err:
        build_task(cfg, "train_judge")
    assert "\n" not in str(err.value)


def test_refuses_splits_shorter_than_a_window(shakespeare_path, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text(shakespeare_path.read_text()[:400])  # val: 40 chars
    cfg = get_config()
    cfg.data.path, cfg.data.window_len = str(small), 40
    with pytest.raises(ValueError, match="val split has 40 chars, too few for windows of data"):
        build_task(cfg, "eval")


def test_refuses_data_without_mask_token(shakespeare_path, tmp_path):
    cfg = get_config()
    cfg.data.path = str(shakespeare_path)
    cfg.judge.checkpoint = str(tmp_path)
    cfg.data.mask_char = ""
    with pytest.raises(ValueError, match="no mask token"):
        build_task(cfg, "train")
    cfg.data.mask_char = "e"  # a corpus char cannot be the mask
    with pytest.raises(ValueError, match="mask_char"):
        build_task(cfg, "train")


def test_refuses_a_judge_that_is_not_a_sequence_scorer(shakespeare_path, tmp_path):
    cfg = get_config()
    cfg.data.path = str(shakespeare_path)
    with pytest.raises(ValueError, match="judge.checkpoint is empty"):
        build_task(cfg, "train")
    # a generator (token-head) checkpoint where the judge should be
    gen = Encoder(vocab_size=66, out_size=65, num_layers=1, d_model=16, max_len=12)
    params = gen.init(jax.random.PRNGKey(0), jnp.zeros((1, 12), jnp.int32))["params"]
    state = TrainState(jnp.zeros((), jnp.int32), params, (), jax.random.PRNGKey(0), jnp.zeros(()))
    with ckpt_lib.Checkpointer(tmp_path / "gen" / "checkpoints") as ck:
        ck.save(1, state, force=True)
    cfg.judge.checkpoint = str(tmp_path / "gen")
    with pytest.raises(ValueError, match="not a sequence scorer") as err:
        build_task(cfg, "train")
    assert "\n" not in str(err.value)


def test_fill_in_run_keeps_judge_and_reference_frozen(
    shakespeare_path, judge_dir, tmp_path, monkeypatch
):
    """Through the real trainer: capture the step's inputs (the frozen reference and judge
    params, exactly the arrays the jitted step receives every step) and check them after."""
    captured = {}
    real_jit_step = sharding.jit_step

    def spy(step_fn, mesh, state, inputs, *args, **kwargs):
        out = real_jit_step(step_fn, mesh, state, inputs, *args, **kwargs)
        captured["inputs"] = out[2]
        captured["frozen"] = jax.device_get((out[2].ref_state, out[2].reward_state))
        captured["params0"] = jax.device_get(out[1].params)
        return out

    monkeypatch.setattr(sharding, "jit_step", spy)
    cfg = fill_config(shakespeare_path, judge_dir)
    judge_before = jax.device_get(ckpt_lib.load_params(judge_dir, captured_template(cfg)))
    state, last = trainer.train_and_evaluate(cfg, str(tmp_path))

    ref0, judge0 = captured["frozen"]
    inputs = captured["inputs"]
    after = jax.device_get((inputs.ref_state, inputs.reward_state))
    for a, b in zip(jax.tree.leaves((ref0, judge0)), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)  # never changed by the donated, jitted steps
    for a, b in zip(jax.tree.leaves(ref0), jax.tree.leaves(captured["params0"]), strict=True):
        np.testing.assert_array_equal(a, b)  # the reference is the initial generator
    for a, b in zip(jax.tree.leaves(judge0), jax.tree.leaves(judge_before), strict=True):
        np.testing.assert_array_equal(a, b)  # the judge is the checkpoint's
    judge_after = ckpt_lib.load_params(judge_dir, judge_before)
    for a, b in zip(jax.tree.leaves(judge_before), jax.tree.leaves(judge_after), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))  # and its checkpoint is untouched
    moved = [
        not np.array_equal(a, np.asarray(b))
        for a, b in zip(
            jax.tree.leaves(captured["params0"]), jax.tree.leaves(state.params), strict=True
        )
    ]
    assert any(moved)  # while the generator does train

    rows = read_metrics(tmp_path)
    train_row = [r for r in rows if "loss" in r][-1]
    for key in STEP_METRICS:
        assert key in train_row and np.isfinite(train_row[key]), key
    for key in ("eval/fill_accuracy", "eval/sampled_fill_accuracy"):
        assert 0.0 <= last[key] <= 1.0, key
    assert cfg.judge.reward == "logit" and np.isfinite(last["eval/judge_reward"])
    assert "eval/pass_at_4" in last
    assert (tmp_path / "checkpoints").is_dir()
    samples = (tmp_path / "samples.txt").read_text()
    assert cfg.data.mask_char in samples  # the masked windows are shown with the mask token


def captured_template(cfg):
    model = judge_lib.make_judge_model(cfg.judge, 65, cfg.data.window_len)
    return model.init(jax.random.PRNGKey(0), jnp.zeros((1, cfg.data.window_len), jnp.int32))[
        "params"
    ]


def test_pretrain_logs_its_fill_accuracy(gen_dir):
    """--mode=pretrain goes through train_state.supervised_update but keeps its metric name."""
    row = [r for r in read_metrics(gen_dir) if "loss" in r][-1]
    assert "train_fill_accuracy" in row and "train_accuracy" not in row
    assert 0.0 <= row["train_fill_accuracy"] <= 1.0 and np.isfinite(row["grad_norm"])


def test_tokens_per_step_counts_every_member(shakespeare_path, judge_dir):
    """tokens_per_s's numerator: prompts × members × the mean span (exhaustive groups have one
    member per corpus char, 65 in tiny Shakespeare; it was counted as group.size)."""
    cfg = fill_config(shakespeare_path, judge_dir)
    b, mean_span = cfg.train.batch_size, (cfg.data.span_min + cfg.data.span_max) / 2
    assert build_task(cfg, "train").tokens_per_step == int(b * cfg.group.size * mean_span)
    cfg.group.mode = "exhaustive"
    assert build_task(cfg, "train").tokens_per_step == int(b * 65 * mean_span)


def test_judge_and_generator_of_another_vocabulary_are_refused(
    shakespeare_path, judge_dir, gen_dir, tmp_path
):
    """A corpus of as many chars, '#' for '$': the same shapes, but every id after '$' means
    another char, so the judge's verdicts (and the generator's fills) would be wrong."""
    other = tmp_path / "other.txt"
    other.write_text(shakespeare_path.read_text().replace("$", "#"))
    cfg = fill_config(shakespeare_path, judge_dir)
    cfg.data.path = str(other)
    with pytest.raises(ValueError, match=r"judge.checkpoint=.*another vocabulary.*train_judge"):
        build_task(cfg, "train")
    cfg.judge.corruptions, cfg.judge.negatives_from = "generator", str(gen_dir)
    with pytest.raises(ValueError, match=r"judge.negatives_from=.*another vocabulary"):
        build_task(cfg, "train_judge")


def test_lr_schedule_spans_every_update(shakespeare_path, judge_dir):
    """mu optimizer updates per step: the cosine must run over num_steps * mu updates, so the
    last step still moves the params (a schedule over num_steps updates reaches lr 0 halfway
    through a mu = 2 run and freezes the second half)."""
    cfg = fill_config(shakespeare_path, judge_dir)
    cfg.optim.warmup_steps, cfg.optim.end_lr_fraction = 0, 0.0
    mu, n = cfg.grpo.num_iterations, cfg.train.num_steps
    assert mu == 2 and n == 4
    task = build_task(cfg, "train")
    params0 = trainer.initial_params(cfg, task)
    step, inputs = task.build(params0)
    step = jax.jit(step.fused)
    state = task.make_state(params0)
    lrs = []
    for _ in range(n):
        before = jax.device_get(state.params)
        state, metrics = step(state, inputs)
        lrs.append(float(metrics["learning_rate"]))
    moved = [
        not np.array_equal(a, np.asarray(b))
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params), strict=True)
    ]
    assert any(moved)  # the last step's updates had a non-zero learning rate
    peak = cfg.optim.learning_rate
    want = [peak * 0.5 * (1 + np.cos(np.pi * s * mu / (n * mu))) for s in range(n)]
    np.testing.assert_allclose(lrs, want, rtol=1e-5)  # logged: the step's first update's lr


def test_eval_reports_greedy_accuracy_per_span_length(shakespeare_path):
    """eval/fill_accuracy/lenK covers the spans of K chars: with one span length it is the
    overall greedy accuracy, and there is no key for the lengths that cannot occur."""
    cfg = get_config()
    cfg.data.path = str(shakespeare_path)
    cfg.data.span_min = cfg.data.span_max = 2
    task = build_task(cfg, "eval")
    scalars, _ = task.evaluate(trainer.initial_params(cfg, task))
    assert scalars["eval/fill_accuracy/len2"] == pytest.approx(scalars["eval/fill_accuracy"])
    assert not {"eval/fill_accuracy/len1", "eval/fill_accuracy/len3"} & set(scalars)


def test_eval_names_only_the_span_lengths_it_has_and_refuses_more_windows(shakespeare_path):
    """With one held-out window there is one span, so one eval/fill_accuracy/lenK (the others
    were logged as 0.0, read as every such span wrong); more windows than the val split holds
    is one error line (they were silently capped)."""
    cfg = get_config()
    cfg.data.path = str(shakespeare_path)
    cfg.eval.num_windows = 1
    task = build_task(cfg, "eval")
    scalars, _ = task.evaluate(trainer.initial_params(cfg, task))
    (key,) = [k for k in scalars if k.startswith("eval/fill_accuracy/len")]
    assert key in {f"eval/fill_accuracy/len{k}" for k in (1, 2, 3)}
    assert scalars[key] == pytest.approx(scalars["eval/fill_accuracy"])
    cfg.eval.num_windows = 100_000
    with pytest.raises(ValueError, match=r"eval.num_windows=100000: the val split \(\d+ tokens\)"):
        build_task(cfg, "eval")


def test_group_sizes_are_checked_against_the_vocabulary(shakespeare_path, judge_dir):
    """group.top_k past the 65-char vocabulary is one error line naming it (it reached
    jax.lax.top_k, whose message names no setting)."""
    cfg = fill_config(shakespeare_path, judge_dir)
    cfg.group.top_k = 1000
    with pytest.raises(ValueError, match="group.top_k=1000 must be <= the vocabulary size 65"):
        build_task(cfg, "train")


def test_the_judges_eval_follows_eval_seed_not_the_training_seed(
    shakespeare_path, gen_dir, judge_dir
):
    """The judge's held-out corruptions are drawn from eval.seed, so judges trained on other
    seeds are scored on the same ones (they followed config.seed)."""
    cfg = get_config()
    cfg.data.path, cfg.judge.negatives_from = str(shakespeare_path), str(gen_dir)
    params = ckpt_lib.load_params(judge_dir, captured_template(cfg))
    scores = {}
    for seed, eval_seed in ((0, 0), (1, 0), (0, 5)):
        cfg.seed, cfg.eval.seed = seed, eval_seed
        scores[seed, eval_seed] = build_task(cfg, "train_judge").evaluate(params)[0]
    assert scores[0, 0] == scores[1, 0] and scores[0, 0] != scores[0, 5]


def optimum_of(shakespeare_path, gen_dir, judge_dir):
    """(config, the generator's params, single_char_optimum on them and the tiny judge): the
    config is the one the diagnostic reads, so a test changes it in place."""
    cfg = fill_config(shakespeare_path, judge_dir)
    s = fill_in.load_setup(cfg)
    template = fill_in.init_fn(s.generator, cfg.data.window_len)(jax.random.PRNGKey(0))
    ref = ckpt_lib.load_params(gen_dir, template)
    jparams = ckpt_lib.load_params(judge_dir, captured_template(cfg))
    return cfg, ref, functools.partial(fill_in_eval.single_char_optimum, cfg, s, ref, jparams)


def test_single_char_optimum_sits_between_reference_and_judge(shakespeare_path, gen_dir, judge_dir):
    """The exact optimum z_ref + (T / beta) r: a policy equal to the reference scores as the
    reference; beta -> inf keeps every reference fill; beta -> 0 follows the judge, whose
    argmax differs from the reference's somewhere (else the diagnostic would show nothing)."""
    cfg, ref, optimum = optimum_of(shakespeare_path, gen_dir, judge_dir)
    out = optimum([ref], num_windows=48)
    assert out["num_windows"] == 48 and out["policies"] == [out["reference"]]
    assert 0.0 <= out["optimum"] <= 1.0
    cfg.grpo.beta = 1e9
    weak = optimum((), 48)
    assert weak["optimum_changed"] == 0.0 and weak["optimum"] == out["reference"]
    cfg.grpo.beta = 1e-9
    assert optimum((), 48)["optimum_changed"] > 0.0


def test_grpos_fixed_point_carries_one_less_one_over_g_of_the_reward(
    shakespeare_path, gen_dir, judge_dir
):
    """Advantages centred on the group's mean, the member's own reward included, carry
    (1 - 1/G) of the reward's gradient, so GRPO's fixed point is the optimum at beta / (1 -
    1/G): at G = 2, the optimum at twice beta. A std scale has no closed form: refused."""
    cfg, _, optimum = optimum_of(shakespeare_path, gen_dir, judge_dir)
    cfg.group.size, cfg.grpo.beta = 2, 0.05
    got = optimum((), 64)
    cfg.grpo.beta = 0.1
    doubled = optimum((), 64)
    assert got["fixed_point"] == doubled["optimum"]
    assert got["fixed_point_changed"] == doubled["optimum_changed"] != got["optimum_changed"]
    cfg.grpo.advantage_scale = "group"
    with pytest.raises(ValueError, match="advantage_scale='group' has no closed-form"):
        optimum((), 64)
