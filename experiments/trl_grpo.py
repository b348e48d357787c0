"""TRL's GRPOTrainer on the same GRPO work as grpo_jax's char Shakespeare step (issue 15).

A randomly initialised GPT-2 (GPT2LMHeadModel, default 4 layers x 4 heads x 128, 170
positions: pre-LN, GELU, tied embeddings, grpo_jax's architecture and parameter count but
for the one extra embedding row) over the corpus's characters plus one end-of-text token;
a char tokenizer (a ``tokenizers`` BPE model with no merges: every character is one token,
decoded by concatenation); prompts = 100-char windows of the train split (the first 90 %
of the text, grpo_jax/data.py's split); the reward grpo_jax's ``match``: the fraction of
the 70 generated chars equal to the true next 70 chars. One optimizer step = one
generation round of 8 prompts x G = 8 completions (per_device_train_batch_size = 64, no
gradient accumulation, steps_per_generation = 1), the horizon forced by ``min_new_tokens``
(the end-of-text token is masked at all 70 positions, so completions are exactly 70
chars), mu = 1, beta = 0.04 against the frozen initial policy (TRL's KL is k3), loss_type
"grpo" (sequence mean of token means, grpo_jax's default aggregation), scale_rewards
"none" (grpo_jax's advantage_scale default), AdamW lr 3e-3, b2 0.99, clip 1.0 (grpo_jax's
optim), fp32 unless --dtype=bfloat16 (bf16 autocast), no gradient checkpointing, no dropout
(GPT-2's default 0.1 set to 0 and TRL's disable_dropout: grpo_jax's RL forwards have none;
records before 2026-11-29 ran TRL's side with 0.1, which --dropout=0.1 reproduces).
Timed per optimizer step by a TrainerCallback (on_step_begin -> on_step_end, CUDA synced).

Needs torch, transformers, trl (and datasets, accelerate): the README's benchmark section
makes a venv for them. The tokenizer, prompts and reward are in experiments/trl_data.py.

  GRPO_JAX_DATA=/work/shared/data/tinyshakespeare.txt \
      /work/trl_venv/bin/python experiments/trl_grpo.py --steps=5 --warmup=2

The LAST printed line is one JSON object; ``run(**kwargs)`` returns the same dict (its
keyword arguments are the flags below, e.g. ``run(steps=5, device="cuda", dtype="bfloat16")``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

import device_lock  # experiments/, beside this file
from trl_data import checked_tokenizer, load_prompts, match_reward

DEFAULTS = {
    "steps": 5,  # timed optimizer steps
    "warmup": 2,  # untimed optimizer steps first
    "device": "auto",  # auto (cuda if available) | cpu | cuda
    "dtype": "float32",  # float32 | bfloat16 (bf16 autocast, fp32 master weights)
    "batch_prompts": 8,  # prompts per optimizer step
    "group": 8,  # completions per prompt (num_generations)
    "context": 100,  # prompt chars
    "horizon": 70,  # generated chars (forced)
    "layers": 4,
    "heads": 4,
    "width": 128,
    "positions": 0,  # GPT-2 n_positions; 0 -> context + horizon (grpo_jax's model.max_len)
    "beta": 0.04,
    "dropout": 0.0,  # GPT-2's dropout rates; grpo_jax's step has none (0.1: GPT-2's default)
    "learning_rate": 3e-3,
    "seed": 0,
    "data": "",  # corpus path; "" -> $GRPO_JAX_DATA
    "train_fraction": 0.9,
    "threads": 0,  # torch.set_num_threads (0 = torch's default)
}


def cpu_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """This machine's CPU as ``cpuinfo`` (its first processor) names it, with its widest x86
    vector unit: 2-core machines of one cloud differ (roofline_cpu.md,
    roofline_cpu_avx512.md), so a CPU record names its CPU; platform.processor() where there
    is no such file."""
    try:
        with open(cpuinfo) as f:
            info = dict(
                ln.split(":", 1) for ln in f.read().split("\n\n")[0].splitlines() if ":" in ln
            )
    except OSError:
        return platform.processor() or "cpu"
    info = {k.strip(): v.strip() for k, v in info.items()}
    flags = set(info.get("flags", "").split())
    simd = next((s for f, s in (("avx512f", "AVX-512"), ("avx2", "AVX2")) if f in flags), "")
    return ", ".join(filter(None, [info.get("model name", platform.processor() or "cpu"), simd]))


def options(kwargs: dict) -> argparse.Namespace:
    """The run's settings: DEFAULTS updated by ``kwargs``, checked before torch is imported."""
    unknown = set(kwargs) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown arguments {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    a = argparse.Namespace(**{**DEFAULTS, **kwargs})
    a.positions = a.positions or a.context + a.horizon
    if a.context + a.horizon > a.positions:
        raise ValueError(
            f"--context + --horizon = {a.context + a.horizon} > --positions={a.positions}; "
            "raise --positions, or pass 0 (context + horizon)"
        )
    if not 0.0 <= a.dropout < 1.0:
        raise ValueError(f"--dropout={a.dropout} must be in [0, 1)")
    if a.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype={a.dtype!r} is unknown; choose from float32, bfloat16")
    a.data = a.data or os.environ.get("GRPO_JAX_DATA", "")
    if not a.data:
        raise ValueError("no corpus: pass --data=PATH or set GRPO_JAX_DATA")
    return a


def step_timer(sync):
    """A TrainerCallback timing each optimizer step (on_step_begin -> on_step_end, ``sync()``
    at both ends: CUDA's queue drained) and the loop end -> end, data loading included."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin, self.step_s, self.loop_s, self.last_end = None, [], [], None

        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            now = time.perf_counter()
            self.step_s.append(now - self.begin)
            if self.last_end is not None:
                self.loop_s.append(now - self.last_end)
            self.last_end = now

    return StepTimer()


def grpo_config(a: argparse.Namespace, total: int, cuda: bool):
    """TRL's GRPOConfig for grpo_jax's step (the module docstring lists the correspondences):
    one generation round of batch_prompts x group completions per optimizer step."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_grpo_out_"),
        max_steps=total,
        per_device_train_batch_size=a.batch_prompts * a.group,  # completions per micro-batch
        gradient_accumulation_steps=1,
        steps_per_generation=1,  # one generation round (8 prompts x G) per optimizer step
        num_generations=a.group,
        max_completion_length=a.horizon,
        generation_kwargs={"min_new_tokens": a.horizon},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        num_iterations=1,
        beta=a.beta,
        epsilon=0.2,
        loss_type="grpo",
        scale_rewards="none",
        learning_rate=a.learning_rate,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=10,
        gradient_checkpointing=False,
        bf16=a.dtype == "bfloat16",
        fp16=False,
        use_cpu=not cuda,
        use_vllm=False,
        log_completions=False,
        logging_steps=10**9,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=a.seed,
        dataloader_num_workers=0,
        disable_dropout=a.dropout == 0,  # the reference's too
    )


def save_random_gpt2(a: argparse.Namespace, tokenizer) -> tuple[str, int]:
    """A randomly initialised GPT-2 of the run's shape saved with its tokenizer: the trainer
    builds its frozen reference from the policy's path, so both load this one model
    (reference = initial policy, grpo_jax's kind=policy). Returns (its folder, params)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model_dir = tempfile.mkdtemp(prefix="trl_grpo_model_")
    gpt = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=a.positions,
            n_embd=a.width,
            n_layer=a.layers,
            n_head=a.heads,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            # grpo_jax's RL forwards have no dropout; GPT-2's default 0.1 makes TRL sample
            # from, score and train a perturbed policy, and draw masks at every layer
            resid_pdrop=a.dropout,
            embd_pdrop=a.dropout,
            attn_pdrop=a.dropout,
        )
    )
    gpt.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, int(sum(p.numel() for p in gpt.parameters()))


def versions() -> dict:
    """The TRL side's software and torch's intra-op thread count."""
    import torch
    import transformers
    import trl

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "python": sys.version.split()[0],
        "threads": torch.get_num_threads(),
    }


def timings(a: argparse.Namespace, timer) -> dict:
    """The timed steps' figures (the warm-up's steps apart)."""
    times = timer.step_s[a.warmup :]
    loops = timer.loop_s[max(a.warmup - 1, 0) :]
    med = statistics.median(times)
    return {
        "warmup": a.warmup,
        "steps": a.steps,
        "median_step_s": med,
        "min_step_s": min(times),
        "max_step_s": max(times),
        "tokens_per_s": a.batch_prompts * a.group * a.horizon / med,
        "step_times_s": times,
        "warmup_step_times_s": timer.step_s[: a.warmup],
        "median_loop_s": statistics.median(loops) if loops else None,
    }


def on_cuda(a: argparse.Namespace, torch) -> bool:
    """Applies --threads and resolves --device=auto; True when the run is on CUDA."""
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device=cuda but torch sees no CUDA device")
    return a.device == "cuda"


def check_counts(a: argparse.Namespace, timer, lengths: list) -> None:
    """Every optimizer step was timed and every completion was scored at the full horizon
    (min_new_tokens forced it): else the times are not of the work grpo_jax's step does."""
    total, n = a.warmup + a.steps, a.batch_prompts * a.group
    if len(timer.step_s) != total:
        raise RuntimeError(f"timed {len(timer.step_s)} optimizer steps, expected {total}")
    if len(lengths) != total * n:
        raise RuntimeError(f"{len(lengths)} completions scored, expected {total * n}")
    if min(lengths) != a.horizon or max(lengths) != a.horizon:
        raise RuntimeError(f"completion lengths {min(lengths)}..{max(lengths)}, not {a.horizon}")


def dropout_of(model, torch, want: float) -> float:
    """The policy's largest dropout rate, its modules' and its attention's (GPT-2 passes
    attn_pdrop to SDPA, no module); the run stops unless it is --dropout's."""
    rates = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    rate = max([*rates, getattr(model.config, "attn_pdrop", 0.0)])
    if rate != want:
        raise RuntimeError(f"the policy's dropout is {rate}, not --dropout={want}")
    return float(rate)


def run(**kwargs) -> dict:
    """Builds and trains for warmup + steps optimizer steps; returns the timing dict."""
    a = options(kwargs)
    import datasets
    import torch
    import transformers
    from transformers import set_seed
    from trl import GRPOTrainer

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    cuda = on_cuda(a, torch)
    set_seed(a.seed)

    total, n_completions = a.warmup + a.steps, a.batch_prompts * a.group
    chars, prompts, targets = load_prompts(
        a.data, a.train_fraction, a.context, a.horizon, a.batch_prompts * total, a.seed
    )
    tokenizer, char_id = checked_tokenizer(chars, prompts[0])
    lengths = []  # completion lengths of every step, checked against the horizon
    timer = step_timer(torch.cuda.synchronize if cuda else lambda: None)
    model_dir, n_params = save_random_gpt2(a, tokenizer)
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=match_reward(char_id, lengths),
        args=grpo_config(a, total, cuda),
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts, "target": targets}),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    dropout = dropout_of(trainer.model, torch, a.dropout)
    with device_lock.timed():  # the warm-up steps too: torch has no compile to share
        t0 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t0

    check_counts(a, timer, lengths)
    log = [h for h in trainer.state.log_history if "train_runtime" not in h]
    dev_name = torch.cuda.get_device_name(0) if cuda else cpu_name()
    return {
        "side": "trl",
        "device": f"{dev_name} / {'cuda' if cuda else 'cpu'}",
        "dtype": a.dtype,
        **versions(),
        "model": f"GPT2LMHeadModel {a.layers}x{a.heads}x{a.width}, {a.positions} positions",
        "vocab_size": len(tokenizer),
        "params": n_params,
        "prompts_per_step": a.batch_prompts,
        "group": a.group,
        "context": a.context,
        "horizon": a.horizon,
        "beta": a.beta,
        "dropout": dropout,
        "tokens_per_step": n_completions * a.horizon,
        "mean_completion_length": sum(lengths) / len(lengths),
        **timings(a, timer),
        "train_s": train_s,
        "last_log": log[-1] if log else None,
        **device_lock.report(),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k}", type=type(v), default=v)
    kwargs = vars(p.parse_args(argv))
    try:
        options(kwargs)  # bad flags: one line, before torch loads
    except ValueError as e:
        sys.exit(f"error: {e}")
    res = run(**kwargs)
    print(
        f"TRL {res['trl']} on {res['device']} ({res['threads']} threads): step median "
        f"{res['median_step_s']:.4f}s (min {res['min_step_s']:.4f}, max {res['max_step_s']:.4f}) "
        f"over {res['steps']} -> {res['tokens_per_s']:.0f} generated tokens/s"
    )
    print(json.dumps(res))


if __name__ == "__main__":
    main()
