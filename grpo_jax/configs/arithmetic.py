"""GRPO with a verifiable reward: arithmetic problems ("47*8=" -> "376" EOS).

Usage:
  python -m grpo_jax.main --config=arithmetic --workdir=runs/arith
      # supervised warm-up in runs/arith/pretrain, then GRPO from it (resumable)
  python -m grpo_jax.main --config=arithmetic:exhaustive --workdir=runs/arith_exh
  python -m grpo_jax.main --config=arithmetic --config.init_from=runs/warm ...

`get_config(arg)` takes comma-separated variant tokens:
  group mode: sampled (default) | exhaustive (every first token forced) | pruned | hierarchical
  rewards:    (none: Python rewards on decoded text) | jax (their jittable twins)
  size:       (none: 2-core CPU, minutes) | tiny (unit tests, seconds)
"""

from ml_collections import config_dict

from grpo_jax import config_blocks as blocks

GROUP_MODES = ("sampled", "exhaustive", "pruned", "hierarchical")
OTHER = ("jax", "tiny")
VARIANTS = GROUP_MODES + OTHER  # the tokens get_config(arg) accepts, comma-separated


def get_config(arg=None):
    tokens = blocks.variant_tokens(arg, VARIANTS, "arithmetic")
    mode = blocks.pick_one(tokens, GROUP_MODES, "sampled", "group modes")

    c = config_dict.ConfigDict()
    c.task = "arithmetic"  # which task plug-in runs (grpo_jax/tasks/__init__.py TASKS)
    c.seed = 0  # root PRNG seed (init, warm-up batches, GRPO steps); problems use problem_seed
    c.init_from = ""  # checkpoint dir to start GRPO from (skips the warm-up)
    c.distributed = False  # join a multi-process run (--coordinator_address ... or auto-detected)
    # XLA:CPU's per-step scratch memory (grpo_jax/host.py): retain (reused from step to step
    # instead of page-faulted in anew) | release (jax's and glibc's defaults)
    c.cpu_buffers = "retain"

    c.data = config_dict.ConfigDict()
    c.data.problem_seed = 0  # seed of the problem sets (fixed across training seeds)
    c.data.max_digits = 2  # operands in [0, 10**max_digits)
    c.data.ops = "+-*"  # operators drawn (each gets an equal share of the problems)
    c.data.mul_max_digits = 1  # digits of the second operand of "*" (0 = max_digits)
    c.data.num_train = 16000  # distinct training problems
    c.data.num_heldout = 512  # distinct held-out problems, disjoint from the training ones
    # T: completion tokens (answer chars + EOS); static, the sampler stops members at EOS
    c.data.max_completion_length = 4

    c.model = config_dict.ConfigDict()
    c.model.num_layers = 2  # transformer blocks
    c.model.num_heads = 4  # attention heads (d_model % num_heads == 0)
    c.model.d_model = 128  # residual width
    c.model.mlp_ratio = 4  # MLP hidden = mlp_ratio * d_model
    c.model.dropout = 0.0  # dropout rate (the warm-up's forwards are deterministic)
    c.model.dtype = "float32"  # compute dtype: float32 | bfloat16 (params stay float32)
    blocks.attention_fields(c.model)  # how attention runs: model.attention
    c.model.max_len = 0  # positional window; 0 -> longest prompt + max_completion_length

    c.pretrain = config_dict.ConfigDict()  # the supervised warm-up (answer then EOS)
    c.pretrain.before_train = True  # --mode=train runs it first in <workdir>/pretrain
    c.pretrain.batch_size = 128  # problems per supervised step
    # supervised steps: held-out pass@1 lands between 20 and 60 % (26-33 % on seeds 0 and 2;
    # batch 64 x 1000 steps left seeds 1 and 2 at 8-11 %, results/arithmetic.md)
    c.pretrain.num_steps = 700
    c.pretrain.learning_rate = 3e-3  # supervised peak learning rate

    c.group = config_dict.ConfigDict()
    c.group.mode = mode  # sampled | exhaustive (all V first tokens forced) | pruned | hierarchical
    # G completions per problem (sampled groups); 16 is also the vocabulary (PAD, EOS, 14
    # chars), so an exhaustive group costs what a sampled one does
    c.group.size = 16
    c.group.temperature = 1.0  # sampling temperature (also that of the training log-probs)
    c.group.top_k = 0  # sample from the top-k tokens only (0 = off)
    c.group.top_p = 1.0  # nucleus sampling mass (1.0 = off)
    blocks.cheap_group_fields(c.group, max_candidates=16, num_classes=4)

    c.reward = config_dict.ConfigDict()
    c.reward.terms = "correct:1.0"  # weighted sum of correct (1/0) and format (1/0)
    c.reward.python = "jax" not in tokens  # Python rewards on decoded text, else jittable twins

    c.grpo = config_dict.ConfigDict()
    c.grpo.beta = 0.0  # KL coefficient to the frozen warm-up policy (0: no reference)
    c.grpo.epsilon = 0.2  # PPO clip (low side)
    c.grpo.epsilon_high = config_dict.placeholder(float)  # PPO clip high side; None -> epsilon
    c.grpo.kl_estimator = "k3"  # k1 | k2 | k3 (sampled tokens) | exact | exact_forward
    c.grpo.loss_agg = "token-mean"  # see objective.AGGREGATIONS
    c.grpo.num_iterations = 1  # mu: optimizer updates per batch of rollouts
    c.grpo.advantage_scale = "group"  # group | batch | none
    c.grpo.entropy_coef = 0.0  # entropy bonus coefficient
    c.grpo.exhaustive_estimator = "expected"  # uniform | expected (exact all-action gradient)

    # AdamW, warmup + cosine. GRPO's peak lr 5e-4: 1e-3 first lost 27 points of greedy
    # accuracy, 2e-4 lifts it too slowly for 1,000 steps (results/arithmetic_warmup64x1000.md)
    c.optim = blocks.optim_block(learning_rate=5e-4)

    c.train = config_dict.ConfigDict()
    c.train.batch_size = 64  # problems per GRPO step
    c.train.num_steps = 2000  # GRPO steps (about 6 min on a quiet 2-core CPU)
    c.train.log_every = 10  # metrics cadence
    c.train.eval_every = 200  # held-out evaluation cadence
    c.train.eval_at_start = True  # also evaluate at step 0 (the warm-up's figures, same metrics)
    c.train.checkpoint_every = 500  # checkpoint cadence
    c.train.keep_checkpoints = 2  # checkpoints kept by the CheckpointManager

    c.eval = config_dict.ConfigDict()
    c.eval.pass_k = (1, 8)  # eval/pass_at_k, unbiased from max(pass_k) samples per problem
    c.eval.temperature = 1.0  # sampling temperature of the pass@k samples
    c.eval.seed = 0  # key of the pass@k samples (the same for every run)
    c.eval.num_samples = 5  # greedy held-out answers written to samples.txt per evaluation

    c.mesh = blocks.mesh_block()  # devices: mesh.data x mesh.member, see grpo_jax/sharding.py
    c.logging = blocks.logging_block(tensorboard=True)
    # 0/1 rewards: a group's std is 0 whenever all members agree, so the low-std warning waits
    c.diagnostics = blocks.diagnostics_block(kl_bound=1.0, reward_std_low=0.05, patience=50)

    if "tiny" in tokens:
        c.model.num_layers = 1
        c.model.d_model = 32
        c.model.num_heads = 2
        c.data.num_train = 256
        c.data.num_heldout = 16
        c.pretrain.num_steps = 4
        c.pretrain.batch_size = 8
        c.train.batch_size = 4
        c.group.size = 4
        c.train.num_steps = 4
        c.train.log_every = 1
        c.train.eval_every = 2
        c.train.checkpoint_every = 2
        c.logging.progress = False
    return c
