"""GRPO on character-level tiny Shakespeare.

Usage:
  python -m grpo_jax.main --config=shakespeare              # exhaustive, CPU-sized
  python -m grpo_jax.main --config=shakespeare:sampled      # G=4 sampled groups
  python -m grpo_jax.main --config=shakespeare:exhaustive,full   # one GPU/TPU

`get_config(arg)` takes comma-separated variant tokens:
  group mode: exhaustive (default) | sampled | guided | adaptive | pruned | hierarchical
  size:       (none: 2-core CPU, ~10 min) | full (one GPU/TPU) | tiny (unit tests, seconds)
  tokenizer:  (none: chars) | bpe<N>: a BPE vocabulary of N tokens trained on the train split
              (bpe = bpe1024; e.g. shakespeare:bpe4096,sampled); windows count tokens
"""

import re

from ml_collections import config_dict

from grpo_jax import config_blocks as blocks

GROUP_MODES = ("exhaustive", "sampled", "guided", "adaptive", "pruned", "hierarchical")
SIZES = ("full", "tiny")
BPE_DEFAULT = 1024  # the vocabulary size of plain "bpe"
BPE = re.compile(r"bpe(\d*)")  # any bpe<N> is accepted; these are the listed examples:
TOKENIZERS = ("bpe", "bpe256", "bpe1024", "bpe4096")
VARIANTS = GROUP_MODES + SIZES + TOKENIZERS  # the tokens get_config(arg) accepts, comma-separated


def bpe_size(arg) -> int:
    """The BPE vocabulary size the variant tokens name (0: chars); two is an error."""
    named = [t.strip() for t in (arg or "").split(",") if BPE.fullmatch(t.strip())]
    if len(named) > 1:
        raise ValueError(f"config variants name two tokenizers {named}; pick one")
    return int(named[0][3:] or BPE_DEFAULT) if named else 0


def get_config(arg=None):
    size = bpe_size(arg)
    bpe_token = [f"bpe{size}", "bpe"] if size else []
    tokens = blocks.variant_tokens(arg, VARIANTS + tuple(bpe_token), "shakespeare")
    mode = blocks.pick_one(tokens, GROUP_MODES, "exhaustive", "group modes")
    blocks.pick_one(tokens, SIZES, None, "sizes")  # full and tiny would mix into a hybrid

    c = config_dict.ConfigDict()
    c.task = "shakespeare"  # which task plug-in runs (grpo_jax/tasks/__init__.py TASKS)
    c.seed = 0  # root PRNG seed; every step's key is fold_in(root, step)
    c.init_from = ""  # checkpoint dir (e.g. a pretrain workdir) to initialise params from
    c.distributed = False  # join a multi-process run (--coordinator_address ... or auto-detected)
    # XLA:CPU's per-step scratch memory (grpo_jax/host.py): retain (reused from step to step
    # instead of page-faulted in anew) | release (jax's and glibc's defaults)
    c.cpu_buffers = "retain"

    c.data = config_dict.ConfigDict()
    c.data.path = ""  # corpus file; "" -> $GRPO_JAX_DATA -> user cache -> download
    # char: one token per character of the corpus | bpe: data.vocab_size BPE tokens trained on
    # the train split (grpo_jax/bpe.py), saved as <workdir>/tokenizer.json and reloaded on resume
    c.data.tokenizer = "bpe" if size else "char"
    c.data.vocab_size = size  # BPE vocabulary size, the corpus's characters included (0: char)
    c.data.context_len = 100  # C: prompt tokens (chars by default) before the decision point
    c.data.horizon = 70  # H: generated tokens scored against the true continuation's tokens
    c.data.train_fraction = 0.9  # contiguous train/val split point (cut in the text)

    c.model = config_dict.ConfigDict()
    c.model.num_layers = 4  # transformer blocks
    c.model.num_heads = 4  # attention heads (d_model % num_heads == 0)
    c.model.d_model = 128  # residual width (~0.83M params at 4x128)
    c.model.mlp_ratio = 4  # MLP hidden = mlp_ratio * d_model
    c.model.dropout = 0.0  # dropout rate (used by pretraining only; RL forwards are deterministic)
    c.model.dtype = "float32"  # compute dtype: float32 | bfloat16 (params stay float32)
    blocks.attention_fields(c.model)  # how attention runs: model.attention
    c.model.max_len = 0  # positional window; 0 -> context_len + horizon

    c.reference = config_dict.ConfigDict()
    c.reference.kind = "ngram"  # ngram | policy (frozen initial policy at group.temperature) | none
    c.reference.ngram_order = 3  # n of the n-gram reference over tokens (1..5)
    c.reference.smoothing = 0.1  # add-k smoothing of the n-gram counts

    c.group = config_dict.ConfigDict()
    c.group.mode = mode  # sampled | exhaustive | guided | adaptive | pruned | hierarchical
    c.group.size = 4  # G for sampled groups (and the non-exhaustive part of adaptive)
    c.group.temperature = 1.0  # sampling temperature (also used for the training log-probs)
    c.group.top_k = 0  # sample from the top-k chars only (0 = off)
    c.group.top_p = 1.0  # nucleus sampling mass (1.0 = off)
    c.group.continuations_per_action = 1  # rollouts per forced first action
    # members per chunk of the rollout (0 = all at once): bounds peak memory by the chunk
    # instead of the group (needed for large V); the result does not depend on it
    c.group.vocab_chunk = 0
    # members per chunk of the loss's training forward (0 = the same as vocab_chunk). Its
    # [B, chunk, H, V] logits are H times the rollout's per-step [B*chunk, V], so at large V
    # (50k) it wants a much smaller chunk than the rollout, which is fastest in few big chunks
    c.group.loss_chunk = 0
    c.group.train_continuations = True  # also train tokens after the decision point
    c.group.entropy_threshold = 2.0  # adaptive: exhaustive where policy entropy (nats) exceeds it
    c.group.guide = "reference"  # guided: who ranks candidates: reference | policy
    c.group.guide_top_k = 10  # guided: top-k candidates when the guide is uncertain
    c.group.guide_top_k_confident = 5  # guided: top-k when the guide is confident
    c.group.guide_random = 15  # guided: random explorers added when uncertain
    # pruned groups cost max_candidates rollouts (static): 16 of the 65 chars. Char classes
    # by kind (letters, spaces, punctuation, ...) put 52 letters in one class, so expanding it
    # costs nearly V: id blocks of 8 chars instead (8 representatives + 9 members)
    blocks.cheap_group_fields(c.group, max_candidates=16, num_classes=8)
    c.group.class_kind = "blocks"

    c.reward = config_dict.ConfigDict()
    c.reward.terms = "match_partial:1.0"  # weighted sum "name:w,name:w" from grpo_jax/rewards
    c.reward.partial_credit = 0.2  # credit for a wrong char in the reference's top-k
    c.reward.partial_topk = 5  # k of that top-k
    c.reward.per_token = False  # keep [B,G,H] rewards (else mean over the horizon -> [B,G])
    # γ: a member's return weights position t by γ^t (normalised; 1.0 = the plain mean)
    c.reward.discount = 1.0

    c.grpo = config_dict.ConfigDict()
    # KL coefficient. From scratch against an n-gram reference the exact KL is the dense,
    # context-aware signal at every generated position; 1.0 lets it lead (0.04 collapses the
    # policy onto frequent chars on CPU budgets, see experiments/results/plain_config.md).
    c.grpo.beta = 1.0
    c.grpo.epsilon = 0.2  # PPO clip (low side)
    c.grpo.epsilon_high = config_dict.placeholder(float)  # PPO clip high side; None -> epsilon
    # exact_forward: KL(π_ref ‖ π) summed over V at every generated position (gradient π − π_ref:
    # mass-covering, distils the n-gram's context-aware predictions into a from-scratch policy;
    # the reverse "exact" KL(π ‖ π_ref) is mode-seeking and from scratch lands on 17 % instead
    # of 24 % held-out accuracy after 60 steps) | exact | k1 | k2 | k3 (sampled-token, reverse)
    c.grpo.kl_estimator = "exact_forward"
    c.grpo.loss_agg = "sequence-mean-token-mean"  # see objective.AGGREGATIONS
    # mu: optimizer updates per batch of rollouts. 2 learns more per CPU second than fresh
    # rollouts do (the rollouts cost about as much as one update). The lr schedule spans all
    # num_steps x mu updates
    c.grpo.num_iterations = 2
    # group | batch | none. "none" keeps raw reward differences: normalised per-position
    # advantages of the continuations mostly reward matching a text the member has left.
    c.grpo.advantage_scale = "none"
    c.grpo.entropy_coef = 0.0  # entropy bonus coefficient
    c.grpo.exhaustive_estimator = "expected"  # uniform | expected (exact all-action gradient)

    c.optim = config_dict.ConfigDict()
    c.optim.learning_rate = 3e-3  # peak learning rate
    c.optim.warmup_steps = 10  # linear warmup, then cosine decay to end_lr_fraction * peak
    c.optim.end_lr_fraction = 0.1  # final lr as a fraction of the peak
    c.optim.weight_decay = 0.0  # AdamW decoupled weight decay
    c.optim.grad_clip = 1.0  # global-norm clip (0 = off)
    c.optim.b1 = 0.9  # Adam beta1
    c.optim.b2 = 0.99  # Adam beta2

    c.train = config_dict.ConfigDict()
    # prompts per step (global across devices). On a CPU budget more updates beat bigger
    # batches: B=2 x 300 steps ended higher than B=4 x 150 (plain_config.md, second round)
    c.train.batch_size = 2
    # GRPO steps: 9 min 37 s exhaustive on a quiet 2-core CPU, 35.5 % held-out next-char
    # accuracy (bigram 27.2 %, trigram 38.3 % on the same windows)
    c.train.num_steps = 300
    c.train.log_every = 5  # metrics cadence (host sync only here)
    c.train.eval_every = 50  # held-out evaluation cadence
    c.train.checkpoint_every = 50  # checkpoint cadence
    c.train.keep_checkpoints = 3  # checkpoints kept by the CheckpointManager

    c.pretrain = config_dict.ConfigDict()
    c.pretrain.batch_size = 24  # windows per supervised step
    # chars per supervised window; 0 -> the model's whole window, so that every position
    # embedding GRPO and the evaluation use (up to context_len + horizon) is trained
    c.pretrain.seq_len = 0
    c.pretrain.num_steps = 1200  # supervised steps for --mode=pretrain (~10 min on 2 cores)
    c.pretrain.learning_rate = 3e-3  # supervised peak learning rate

    c.eval = config_dict.ConfigDict()
    # held-out windows per evaluation (x horizon predictions: 1024 x 70 keeps the accuracy's
    # standard error near 0.2 points, small enough to compare with the n-gram baselines)
    c.eval.num_windows = 1024
    c.eval.batch_size = 64  # windows per eval forward
    c.eval.pass_k = (1, 4)  # k values for eval/pass_at_k (first char right in k samples)
    c.eval.num_samples = 3  # decoded samples written to samples.txt per evaluation
    # n-gram orders whose accuracy on the same eval windows is logged as
    # eval/ngram{k}_next_char_accuracy (fitted on the train split; () = none)
    c.eval.ngram_baselines = (1, 2, 3)

    c.mesh = blocks.mesh_block()  # devices: mesh.data x mesh.member, see grpo_jax/sharding.py
    c.logging = blocks.logging_block(tensorboard=True, char_stats_every=25)
    # warn when kl > 0.1 or the group reward std stays outside [0.3, 2.0] for 20 logged steps.
    # From scratch the KL to the trigram starts near 2 nats/char and settles around 0.5, so the
    # plain config warns early on purpose: its policy is far from the reference
    c.diagnostics = blocks.diagnostics_block()

    if size:
        # n-gram tables hold a dense row of V log-probs per seen context: order 3 over 1024
        # tokens is 61M entries (~2 GB to count), over 4096 past reference.MAX_TABLE_ENTRIES
        c.reference.ngram_order = 2
        c.eval.ngram_baselines = (1, 2)
        # most BPE tokens start with a letter or a space: first-char classes would hold
        # hundreds of tokens each; id blocks follow the merge (frequency) order instead
        c.group.num_classes = 32  # 32 representatives + 32 members of the heaviest block
        c.group.max_candidates = 64
        c.logging.char_stats_every = 0  # a V-row heatmap: 51 s to draw at V = 4096, unreadable
    if mode == "sampled":
        c.group.size = 4
    elif mode == "adaptive":
        c.group.size = 4
    elif mode == "exhaustive" and not size and "full" not in tokens:
        # the 65 forced chars' training forward in five chunks of 13 members: on 2 CPU cores
        # a chunk holds 2 x 13 x 69 = 1,794 of the 8,970 rows (a smaller working set; the
        # cause is not profiled) and the plain config's step takes 0.59-0.62 s instead of
        # 0.67-0.69 s with the same loss (experiments/results/roofline_cpu_avx512.md;
        # group.loss_chunk=0 restores one chunk); unmeasured on an accelerator: `full` keeps one
        c.group.loss_chunk = 13

    if "full" in tokens:
        c.model.num_layers = 6
        c.model.num_heads = 6
        c.model.d_model = 384
        c.model.dtype = "bfloat16"
        c.train.batch_size = 32
        c.train.num_steps = 2000
        c.train.log_every = 10
        c.train.eval_every = 200
        c.train.checkpoint_every = 200
        c.pretrain.batch_size = 64
        c.pretrain.num_steps = 5000
        c.eval.num_windows = 1024
    if "tiny" in tokens:
        c.model.num_layers = 1
        c.model.num_heads = 2
        c.model.d_model = 32
        c.data.context_len = 16
        c.data.horizon = 8
        c.train.batch_size = 2
        c.train.num_steps = 3
        c.train.log_every = 1
        c.train.eval_every = 3
        c.train.checkpoint_every = 2
        c.pretrain.batch_size = 4
        c.pretrain.seq_len = 24
        c.pretrain.num_steps = 3
        c.eval.num_windows = 8
        c.eval.ngram_baselines = (2,)
        c.eval.batch_size = 8
        c.logging.progress = False
        c.logging.char_stats_every = 1
        c.group.guide_top_k = 4
        c.group.guide_top_k_confident = 2
        c.group.guide_random = 3
    return c
