"""The config, validated once into small frozen specs that the factories take.

Every engine setting has exactly one check here and one error message, naming the field, the
value and what would be valid; the factories (groups, loss, step, optimizer) receive these
specs and never look at the config again. The settings every run shares beside the engine's
(seed, reporting, host buffers) are checked in run_spec.py; task-specific ones (data, reward,
reference, judge, ...) by their task's own ``specs(config)`` in grpo_jax/tasks/, the same way.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend

from grpo_jax import objective
from grpo_jax.decode_kernel import LEAST_HEAD_DIM
from grpo_jax.model import ATTENTION, DECODE_KERNELS
from grpo_jax.rollout import SamplingParams
from grpo_jax.validate import boolean, choice, integer, number, require

GROUP_MODES = ("sampled", "exhaustive", "guided", "adaptive", "pruned", "hierarchical")
CLASS_KINDS = ("chars", "blocks")
CONTINUATION_CREDITS = ("position", "return")
ESTIMATORS = ("uniform", "expected")
GUIDES = ("reference", "policy")
HALF = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """How each prompt's group is formed (groups.py)."""

    mode: str
    size: int  # G of sampled groups (and of adaptive's sampled part)
    continuations_per_action: int
    vocab_chunk: int  # rollout members per chunk (0 = all)
    loss_chunk: int  # training-forward members per chunk (0 = vocab_chunk)
    train_continuations: bool
    entropy_threshold: float
    guide: str
    guide_top_k: int
    guide_top_k_confident: int
    guide_random: int
    coverage: float  # pruned: the guide's mass the candidates must cover
    max_candidates: int  # pruned: static group size (candidates beyond it are cut)
    class_kind: str  # hierarchical: how tokens are grouped (candidates.token_classes)
    num_classes: int  # hierarchical, class_kind=blocks: number of id blocks
    expand_classes: int  # hierarchical: classes whose every member is rolled out
    value_horizon: int  # forced members' horizon (0 = the task's full horizon)
    decision_points: int  # forced groups per rollout, at its highest-entropy positions
    continuation_credit: str  # forced members' tokens after the first: position | return
    sampling: SamplingParams

    @classmethod
    def from_config(cls, g) -> GroupSpec:
        mode = choice("group.mode", g.mode, GROUP_MODES)
        low = 2 if mode in ("sampled", "adaptive") else 1  # a sampled group needs a baseline
        sampling = SamplingParams(
            number("group.temperature", g.temperature, 0.0, open_low=True),
            integer("group.top_k", g.top_k),
            number("group.top_p", g.top_p, 0.0, 1.0, open_low=True),
        )
        spec = cls(
            mode=mode,
            size=integer("group.size", g.size, low),
            continuations_per_action=integer(
                "group.continuations_per_action", g.get("continuations_per_action", 1), 1
            ),
            vocab_chunk=integer("group.vocab_chunk", g.get("vocab_chunk", 0)),
            loss_chunk=integer("group.loss_chunk", g.get("loss_chunk", 0)),
            train_continuations=boolean(
                "group.train_continuations", g.get("train_continuations", True)
            ),
            entropy_threshold=number("group.entropy_threshold", g.get("entropy_threshold", 0.0)),
            guide=choice("group.guide", g.get("guide", "policy"), GUIDES),
            guide_top_k=integer("group.guide_top_k", g.get("guide_top_k", 1), 1),
            guide_top_k_confident=integer(
                "group.guide_top_k_confident", g.get("guide_top_k_confident", 1), 1
            ),
            guide_random=integer("group.guide_random", g.get("guide_random", 0)),
            coverage=number("group.coverage", g.get("coverage", 0.95), 0.0, 1.0, open_low=True),
            max_candidates=integer("group.max_candidates", g.get("max_candidates", 64), 1),
            class_kind=choice("group.class_kind", g.get("class_kind", "chars"), CLASS_KINDS),
            num_classes=integer("group.num_classes", g.get("num_classes", 32), 1),
            expand_classes=integer("group.expand_classes", g.get("expand_classes", 1), 1),
            value_horizon=integer("group.value_horizon", g.get("value_horizon", 0)),
            decision_points=integer("group.decision_points", g.get("decision_points", 1), 1),
            continuation_credit=choice(
                "group.continuation_credit",
                g.get("continuation_credit", "position"),
                CONTINUATION_CREDITS,
            ),
            sampling=sampling,
        )
        spec.check_relations()
        return spec

    def check_relations(self) -> None:
        """The settings that constrain each other (each alone is checked in from_config)."""
        require(
            self.mode != "sampled" or self.value_horizon == 0,
            "group.value_horizon",
            self.value_horizon,
            "must be 0 with group.mode=sampled (it shortens forced members only)",
        )
        if self.decision_points > 1:
            require(
                self.mode not in ("sampled", "adaptive"),
                "group.decision_points",
                self.decision_points,
                f"must be 1 with group.mode={self.mode} (decision points force groups: use "
                "exhaustive, pruned, hierarchical or guided)",
            )
            require(
                self.value_horizon > 0,
                "group.decision_points",
                self.decision_points,
                "must be 1 unless group.value_horizon > 0 (later decision points need room)",
            )
        require(
            self.guide_top_k_confident <= self.guide_top_k,
            "group.guide_top_k_confident",
            self.guide_top_k_confident,
            f"must be <= group.guide_top_k={self.guide_top_k}",
        )

    def check_vocab(self, vocab_size: int, horizon: int | None = None) -> None:
        """Relations to the task's vocabulary (and completion length), checked before anything
        is built."""
        if horizon is not None:
            require(
                self.value_horizon <= horizon,
                "group.value_horizon",
                self.value_horizon,
                f"must be <= the completion length {horizon}",
            )
            room = horizon - self.forced_horizon(horizon) + 1
            require(
                self.decision_points <= room,
                "group.decision_points",
                self.decision_points,
                f"must be <= {room}: positions 0..T - value_horizon of a {horizon}-token "
                "completion",
            )
        require(
            self.sampling.top_k <= vocab_size,
            "group.top_k",
            self.sampling.top_k,
            f"must be <= the vocabulary size {vocab_size} (0 = off)",
        )
        if self.mode == "pruned":
            require(
                self.max_candidates <= vocab_size,
                "group.max_candidates",
                self.max_candidates,
                f"must be <= the vocabulary size {vocab_size}",
            )
        if self.mode == "hierarchical" and self.class_kind == "blocks":
            require(
                self.num_classes <= vocab_size,
                "group.num_classes",
                self.num_classes,
                f"must be <= the vocabulary size {vocab_size}",
            )
        if self.mode == "guided":
            n = self.guide_top_k + self.guide_random
            require(
                n <= vocab_size,
                "group.guide_top_k",
                self.guide_top_k,
                f"must keep guide_top_k + guide_random = {n} <= the vocabulary size {vocab_size}",
            )

    def forced_horizon(self, horizon: int) -> int:
        """Tokens a forced member generates: group.value_horizon, or the whole horizon."""
        return min(self.value_horizon or horizon, horizon)

    @property
    def forced(self) -> tuple[bool, ...]:
        """Which parts of a collected group are forced (static; see groups.py)."""
        return {
            "sampled": (False,),
            "exhaustive": (True,),
            "guided": (True,),
            "pruned": (True,),
            "hierarchical": (True,),
            "adaptive": (False, True),
        }[self.mode]


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
    """The GRPO loss and the μ updates per batch (loss.py, engine.py)."""

    beta: float
    epsilon: float
    epsilon_high: float | None
    kl_estimator: str
    loss_agg: str
    num_iterations: int
    advantage_scale: str
    entropy_coef: float
    exhaustive_estimator: str

    @classmethod
    def from_config(cls, gr) -> ObjectiveSpec:
        eps_high = gr.get("epsilon_high")
        return cls(
            beta=number("grpo.beta", gr.beta, 0.0),
            epsilon=number("grpo.epsilon", gr.epsilon, 0.0, 1.0, open_low=True),
            epsilon_high=None
            if eps_high is None
            else number("grpo.epsilon_high", eps_high, 0.0, open_low=True),
            kl_estimator=choice("grpo.kl_estimator", gr.kl_estimator, objective.KL_CHOICES),
            loss_agg=choice("grpo.loss_agg", gr.loss_agg, tuple(objective.AGGREGATIONS)),
            num_iterations=integer("grpo.num_iterations", gr.num_iterations, 1),
            advantage_scale=choice(
                "grpo.advantage_scale", gr.advantage_scale, objective.ADVANTAGE_SCALES
            ),
            entropy_coef=number("grpo.entropy_coef", gr.get("entropy_coef", 0.0)),
            exhaustive_estimator=choice(
                "grpo.exhaustive_estimator", gr.get("exhaustive_estimator", "expected"), ESTIMATORS
            ),
        )


@dataclasses.dataclass(frozen=True)
class OptimSpec:
    learning_rate: float
    warmup_steps: int
    end_lr_fraction: float
    weight_decay: float
    grad_clip: float
    b1: float
    b2: float

    @classmethod
    def from_config(cls, o, learning_rate=None, lr_field="optim.learning_rate") -> OptimSpec:
        """``learning_rate``: a mode's own peak (e.g. pretrain.learning_rate, named by
        ``lr_field``) in place of optim.learning_rate."""
        lr = o.learning_rate if learning_rate is None else learning_rate
        return cls(
            learning_rate=number(lr_field, lr, 0.0, open_low=True),
            warmup_steps=integer("optim.warmup_steps", o.warmup_steps),
            end_lr_fraction=number("optim.end_lr_fraction", o.end_lr_fraction, 0.0, 1.0),
            weight_decay=number("optim.weight_decay", o.weight_decay, 0.0),
            grad_clip=number("optim.grad_clip", o.grad_clip, 0.0),
            # Adam's bias correction divides by 1 - b**t: b = 1 would divide by 0
            b1=number("optim.b1", o.b1, 0.0, 1.0, open_high=True),
            b2=number("optim.b2", o.b2, 0.0, 1.0, open_high=True),
        )


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """The host loop's sizes and cadences (trainer.py)."""

    batch_size: int
    num_steps: int
    log_every: int
    eval_every: int
    checkpoint_every: int
    keep_checkpoints: int
    eval_at_start: bool

    @classmethod
    def from_config(cls, t) -> TrainSpec:
        return cls(
            batch_size=integer("train.batch_size", t.batch_size, 1),
            num_steps=integer("train.num_steps", t.num_steps),
            log_every=integer("train.log_every", t.log_every, 1),
            eval_every=integer("train.eval_every", t.eval_every, 1),
            checkpoint_every=integer("train.checkpoint_every", t.checkpoint_every, 1),
            keep_checkpoints=integer("train.keep_checkpoints", t.keep_checkpoints, 1),
            eval_at_start=boolean("train.eval_at_start", t.get("eval_at_start", False)),
        )


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The transformer's shape (model.py); the task supplies the vocabulary and window."""

    num_layers: int
    num_heads: int
    d_model: int
    mlp_ratio: int
    dropout: float
    dtype: str
    attention: str = "shared_prefix"
    decode_kernel: str = "xla"

    @classmethod
    def from_config(cls, m) -> ModelSpec:
        spec = cls(
            num_layers=integer("model.num_layers", m.num_layers, 1),
            num_heads=integer("model.num_heads", m.num_heads, 1),
            d_model=integer("model.d_model", m.d_model, 1),
            mlp_ratio=integer("model.mlp_ratio", m.mlp_ratio, 1),
            dropout=number("model.dropout", m.get("dropout", 0.0), 0.0, 1.0),
            dtype=choice(
                "model.dtype", m.get("dtype", "float32"), ("float32", "bfloat16", "float16")
            ),
            attention=choice("model.attention", m.get("attention", "shared_prefix"), ATTENTION),
            decode_kernel=choice(
                "model.decode_kernel", m.get("decode_kernel", "xla"), DECODE_KERNELS
            ),
        )
        require(
            spec.d_model % spec.num_heads == 0,
            "model.d_model",
            spec.d_model,
            f"must be divisible by model.num_heads={spec.num_heads}",
        )
        if spec.attention == "cudnn":  # jax's cuDNN flash attention (its own check names the
            # head dimension's upper bound: 128 before Hopper, 256 after)
            fix = "else use model.attention='shared_prefix' (any device) or 'xla'"
            multiple_of_8 = (lambda hd: hd % 8 == 0, "a multiple of 8")
            spec.check_gpu_kernel("model.attention", "cudnn", multiple_of_8, fix, half=True)
        if spec.decode_kernel != "xla":  # decode_kernel.py, Triton kernels (elsewhere JAX
            # could only interpret them, as the tests do)
            least = LEAST_HEAD_DIM[spec.decode_kernel]
            words = "a power of two" + (f" of at least {least}" if least > 1 else "")
            head = (lambda hd: hd & (hd - 1) == 0 and hd >= least, words)
            spec.check_gpu_kernel("model.decode_kernel", spec.decode_kernel, head, "else use 'xla'")
        return spec

    def check_gpu_kernel(self, setting: str, value: str, head: tuple, fix: str, half=False):
        """``setting=value`` chose a GPU kernel: its requirements as config errors, one line
        each naming ``fix``: a CUDA GPU, half precision where ``half``, and a head dimension
        passing ``head`` = (test, its words)."""
        runtime, hd = gpu_runtime(), self.d_model // self.num_heads
        needs = [("cuda" in runtime, f"a CUDA GPU, not {runtime}")]
        if half:
            needs.append((self.dtype in HALF, f"model.dtype bfloat16 or float16, not {self.dtype}"))
        needs.append((head[0](hd), f"a head dimension (model.d_model / model.num_heads = {hd}) "
                      f"that is {head[1]}"))  # fmt: skip
        for ok, need in needs:
            require(ok, setting, value, f"needs {need}; {fix}")


def gpu_runtime() -> str:
    """The backend's name, or on a GPU its runtime ("cuda 12080", "rocm 60300"): jax calls
    both CUDA and ROCm GPUs "gpu", and only CUDA has cuDNN (jax's own cuDNN check reads the
    same string)."""
    backend = jax.default_backend()
    return jax.extend.backend.get_backend().platform_version if backend == "gpu" else backend


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Everything the one GRPO step needs from the config."""

    group: GroupSpec
    objective: ObjectiveSpec
    train: TrainSpec

    @classmethod
    def from_config(cls, config) -> EngineSpec:
        spec = cls(
            GroupSpec.from_config(config.group),
            ObjectiveSpec.from_config(config.grpo),
            TrainSpec.from_config(config.train),
        )
        require(
            spec.group.mode != "hierarchical" or spec.objective.exhaustive_estimator == "expected",
            "grpo.exhaustive_estimator",
            spec.objective.exhaustive_estimator,
            "must be 'expected' with group.mode=hierarchical (its estimator is all-action)",
        )
        return spec
