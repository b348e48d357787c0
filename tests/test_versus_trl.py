"""experiments/versus_trl.py, issue 15's side-by-side harness: its summary on hand-made rounds,
and a real run at tiny sizes: grpo_jax's real benchmark step beside a stand-in for the
TRL side (CI has no torch) that parses its flags with trl_grpo.py's own parser and reports
fixed step times, so the ratios the harness writes can be checked against known numbers."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compilation_cache_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

from trl_grpo import cpu_name  # noqa: E402
from versus_trl_report import summary_of  # noqa: E402

TRL_STEP_S = (0.3, 0.2, 0.4)  # the stand-in's step times: median 0.3

STAND_IN = """#!{python}
import sys
sys.path.insert(0, {experiments!r})
import trl_grpo

assert sys.argv[1].endswith("experiments/trl_grpo.py"), sys.argv
STEP_S = {step_s!r}


def run(**kwargs):
    a = {{**trl_grpo.DEFAULTS, **kwargs}}
    tokens = a["batch_prompts"] * a["group"] * a["horizon"]
    med = sorted(STEP_S)[len(STEP_S) // 2]
    return dict(
        trl="stand-in", transformers="-", torch="-", python="-", device="cpu", threads=1,
        model="stand-in", vocab_size=66, params=0, tokens_per_step=tokens, steps=a["steps"],
        mean_completion_length=a["horizon"], median_step_s=med, min_step_s=min(STEP_S),
        max_step_s=max(STEP_S), tokens_per_s=tokens / med, step_times_s=list(STEP_S),
    )


trl_grpo.run = run
trl_grpo.main(sys.argv[2:])
"""


def test_the_summary_takes_medians_over_rounds_and_the_fastest_steps():
    def side(median, fastest):
        return {"median_step_s": median, "min_step_s": fastest, "tokens_per_s": 1 / median,
                "compile_s": 2 * median}  # fmt: skip

    jax = [side(1.0, 0.9), side(2.0, 0.5), side(10.0, 1.0)]
    trl = [side(3.0, 2.0), side(6.0, 4.0), side(3.0, 1.5)]
    rounds = [
        {"grpo_jax": j, "trl": t, "ratio": t["median_step_s"] / j["median_step_s"]}
        for j, t in zip(jax, trl, strict=True)
    ]
    s = summary_of(rounds)
    assert s["grpo_jax_s_per_step"] == {"median": 2.0, "min": 1.0, "max": 10.0}
    assert s["ratio_of_medians"] == 3.0 / 2.0  # not the mean's 4 / 4.33
    assert s["ratio_per_round"] == {"median": 3.0, "min": 0.3, "max": 3.0}
    assert (s["grpo_jax_fastest_step_s"], s["trl_fastest_step_s"]) == (0.5, 1.5)
    assert s["ratio_of_fastest"] == 3.0
    assert s["trl_tokens_per_s"] == 1 / 3.0 and s["grpo_jax_compile_s"]["median"] == 4.0


def test_a_tiny_run_records_both_sides_and_their_ratios(
    tmp_path, tmp_path_factory, shakespeare_path
):
    trl_python = tmp_path / "trl_python"
    trl_python.write_text(
        STAND_IN.format(
            python=sys.executable, experiments=str(ROOT / "experiments"), step_s=TRL_STEP_S
        )
    )
    trl_python.chmod(0o755)
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(compilation_cache_dir(tmp_path_factory)),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # the second round loads the first's
    }
    work = ["--batch_prompts=2", "--group=3", "--context=8", "--horizon=4", "--layers=1"]
    work += ["--heads=2", "--width=16", "--rounds=2", "--steps=2", "--warmup=0"]
    cmd = [sys.executable, "experiments/versus_trl.py", *work, "--wait_quiet=0"]
    cmd += [f"--trl_python={trl_python}", "--jax_args=--noroofline", f"--data={shakespeare_path}"]
    cmd += [f"--out_dir={tmp_path}", "--name=tiny"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]

    rec = json.loads((tmp_path / "tiny.json").read_text())
    assert [r["round"] for r in rec["rounds"]] == [1, 2]
    jax_medians = []
    for r in rec["rounds"]:
        gj, trl = r["grpo_jax"], r["trl"]
        # the work's flags reached benchmark.py: 2 prompts x 3 members x 4 tokens, 2 timed steps
        assert gj["tokens_per_step"] == 24 and len(gj["step_times_s"]) == 2
        assert gj["median_step_s"] == pytest.approx(statistics.median(gj["step_times_s"]))
        assert (gj["min_step_s"], gj["max_step_s"]) == (
            min(gj["step_times_s"]),
            max(gj["step_times_s"]),
        )
        assert trl["median_step_s"] == 0.3 and trl["tokens_per_step"] == 24
        assert r["ratio"] == pytest.approx(0.3 / gj["median_step_s"])
        jax_medians.append(gj["median_step_s"])
    s = rec["summary"]
    assert s["ratio_of_medians"] == pytest.approx(0.3 / statistics.median(jax_medians))
    assert s["ratio_of_fastest"] == pytest.approx(
        0.2 / min(min(r["grpo_jax"]["step_times_s"]) for r in rec["rounds"])
    )
    assert rec["trl_env"]["trl"] == "stand-in" and rec["work"]["horizon"] == 4
    assert "experiments/trl_grpo.py" in rec["commands"]["trl"]
    assert "--horizon=4" in rec["commands"]["trl"]
    assert "--config.data.horizon=4" in rec["commands"]["grpo_jax"]
    md = (tmp_path / "tiny.md").read_text()
    assert f"TRL takes {s['ratio_of_medians']:.2f}x as long per step" in md
    assert md.count("\n| 1 | ") == 1 and md.count("\n| 2 | ") == 1


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dtype=float16"], "--dtype='float16' is unknown; choose from float32, bfloat16"),
        (
            ["--context=150", "--positions=160"],
            "--context + --horizon = 220 > --positions=160; raise --positions, or pass 0",
        ),
        ([], "no corpus: pass --data=PATH or set GRPO_JAX_DATA"),
        (["--dropout=1.0", "--data=x"], "--dropout=1.0 must be in [0, 1)"),
    ],
)
def test_the_trl_side_refuses_bad_flags_in_one_line_before_torch_loads(flags, message):
    """CI has no torch: these exits come from the flags' check, which runs before the import."""
    env = {k: v for k, v in os.environ.items() if k != "GRPO_JAX_DATA"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "trl_grpo.py"), *flags],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: {message}")


def test_the_trl_side_runs_without_dropout_unless_asked():
    """grpo_jax's step has no dropout, so TRL's GPT-2 runs with none by default (it ran with
    GPT-2's default 0.1 until 2026-11-29, in generation and training): trl_grpo.dropout_of
    reads the policy's modules and its attention rate, and stops a run whose rate is not
    --dropout's (a fake torch here: CI has none)."""
    from types import SimpleNamespace

    import trl_grpo

    class Dropout:
        def __init__(self, p):
            self.p = p

    fake_torch = SimpleNamespace(nn=SimpleNamespace(Dropout=Dropout))

    def model(module_p, attn_p):
        modules = [object(), Dropout(module_p)]
        return SimpleNamespace(modules=lambda: modules, config=SimpleNamespace(attn_pdrop=attn_p))

    assert trl_grpo.DEFAULTS["dropout"] == 0.0
    assert trl_grpo.dropout_of(model(0.0, 0.0), fake_torch, 0.0) == 0.0
    assert trl_grpo.dropout_of(model(0.1, 0.1), fake_torch, 0.1) == 0.1
    for module_p, attn_p in ((0.1, 0.0), (0.0, 0.1)):
        with pytest.raises(RuntimeError, match="dropout is 0.1, not --dropout=0.0"):
            trl_grpo.dropout_of(model(module_p, attn_p), fake_torch, 0.0)


@pytest.mark.parametrize(
    "flags, expected",
    [("fpu avx2 avx512f avx512bw", "EPYC 9B14, AVX-512"), ("fpu sse2 avx2", "EPYC 9B14, AVX2"),
     ("fpu sse2", "EPYC 9B14")],
)  # fmt: skip
def test_cpu_name_reads_the_first_processor_and_its_widest_vector_unit(tmp_path, flags, expected):
    second = "processor\t: 1\nmodel name\t: Other CPU\nflags\t\t: avx512f\n"
    info = f"processor\t: 0\nmodel name\t: EPYC 9B14\nflags\t\t: {flags}\n\n{second}"
    (tmp_path / "cpuinfo").write_text(info)
    assert cpu_name(str(tmp_path / "cpuinfo")) == expected
