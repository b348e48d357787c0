"""GRPO on the toy contextual bandit (grpo_jax/tasks/toy_bandit.py): SFT -> reward model -> GRPO.

Usage:
  python -m grpo_jax.main --config=toy_bandit:rm --workdir=runs/toy_rm
  python -m grpo_jax.main --config=toy_bandit:rlvr --workdir=runs/toy_rlvr
  python -m grpo_jax.main --config=toy_bandit:rlvr --config.seed=1 ...

`get_config(arg)` takes comma-separated variant tokens:
  reward: rm (default; Bradley–Terry reward model, G=8) | rlvr (binary verifiable reward, G=16)
  group:  sampled (default) | exhaustive (the group is all V actions: the exact policy gradient)
  size:   (none: the tutorial's 500 iterations, ~10 s on CPU) | tiny (unit tests, seconds)
The SFT policy and the reward model are trained inside the task, deterministically from the
seed, before GRPO starts (a few seconds on a CPU); there is no separate mode for them.
"""

from ml_collections import config_dict

from grpo_jax import config_blocks as blocks

REWARDS = ("rm", "rlvr")
GROUP_MODES = ("sampled", "exhaustive")
SIZES = ("tiny",)
VARIANTS = REWARDS + GROUP_MODES + SIZES  # the tokens get_config(arg) accepts, comma-separated


def get_config(arg=None):
    tokens = blocks.variant_tokens(arg, VARIANTS, "toy_bandit")
    reward = blocks.pick_one(tokens, REWARDS, "rm", "rewards")
    mode = blocks.pick_one(tokens, GROUP_MODES, "sampled", "group modes")

    c = config_dict.ConfigDict()
    c.task = "toy_bandit"  # which task plug-in runs (grpo_jax/tasks/__init__.py TASKS)
    c.seed = 0  # root PRNG seed: SFT, reward model, GRPO steps (and the world, see toy.world_seed)
    c.init_from = ""  # checkpoint dir to initialise the policy from (default: the SFT policy)
    c.distributed = False  # join a multi-process run (--coordinator_address ... or auto-detected)
    # XLA:CPU's per-step scratch memory (grpo_jax/host.py): retain (reused from step to step
    # instead of page-faulted in anew) | release (jax's and glibc's defaults)
    c.cpu_buffers = "retain"

    c.toy = config_dict.ConfigDict()
    c.toy.reward = reward  # rm (Bradley–Terry reward model) | rlvr (1 for the best token)
    c.toy.world_seed = -1  # seed of the embeddings and true preferences; -1 -> c.seed
    c.toy.num_contexts = 5  # N contexts (prompts)
    c.toy.context_dim = 8  # d of the fixed random context embeddings
    c.toy.vocab_size = 10  # V tokens (actions)
    c.toy.pref_temperature = 2.0  # true preferences softmax(pref_temperature * z), z ~ N(0, 1)
    c.toy.hidden = 32  # hidden units of the MLP policy and of the reward model
    c.toy.sft = config_dict.ConfigDict()
    c.toy.sft.num_steps = 2000  # SFT Adam steps on samples from the true preferences
    c.toy.sft.batch_size = 32  # (context, token) samples per SFT step
    c.toy.sft.learning_rate = 1e-2  # SFT Adam learning rate
    c.toy.rm = config_dict.ConfigDict()
    c.toy.rm.num_steps = 2000  # Bradley–Terry Adam steps (toy.reward=rm only)
    c.toy.rm.batch_size = 64  # simulated comparisons per step
    c.toy.rm.learning_rate = 3e-3  # reward-model Adam learning rate
    c.toy.rm.bt_scale = 10.0  # P(a ≻ b) = sigmoid(bt_scale * (p(c,a) - p(c,b)))

    c.group = config_dict.ConfigDict()
    # sampled: G samples per context | exhaustive: all V actions, each forced, learning by the
    # exact all-action gradient Σ_a π(a)·Â(a)·∇log π(a) (grpo_jax/loss.py)
    c.group.mode = mode
    c.group.size = 8 if reward == "rm" else 16  # G samples per context (sampled groups)
    c.group.temperature = 1.0  # sampling temperature (also used for the training log-probs)
    c.group.top_k = 0  # sample from the top-k tokens only (0 = off)
    c.group.top_p = 1.0  # nucleus sampling mass (1.0 = off)

    c.grpo = config_dict.ConfigDict()
    c.grpo.beta = 0.05  # KL coefficient (to the frozen SFT policy)
    c.grpo.epsilon = 0.2  # PPO clip (low side)
    c.grpo.epsilon_high = config_dict.placeholder(float)  # PPO clip high side; None -> epsilon
    c.grpo.kl_estimator = "exact"  # exact (over V) | k1 | k2 | k3
    c.grpo.loss_agg = "sequence-mean-token-mean"  # see objective.AGGREGATIONS
    c.grpo.num_iterations = 2  # mu: PPO epochs (optimizer updates) per batch of rollouts
    c.grpo.advantage_scale = "group"  # group | batch | none
    c.grpo.entropy_coef = 0.0  # entropy bonus coefficient

    c.optim = config_dict.ConfigDict()
    c.optim.learning_rate = 1e-3  # peak learning rate
    c.optim.warmup_steps = 0  # linear warmup, then cosine decay to end_lr_fraction * peak
    c.optim.end_lr_fraction = 1.0  # 1.0 = constant learning rate (the tutorial's Adam)
    c.optim.weight_decay = 0.0  # AdamW decoupled weight decay
    c.optim.grad_clip = 0.0  # global-norm clip (0 = off)
    c.optim.b1 = 0.9  # Adam beta1
    c.optim.b2 = 0.999  # Adam beta2

    c.train = config_dict.ConfigDict()
    c.train.batch_size = 8  # prompts (contexts, drawn uniformly) per iteration
    c.train.num_steps = 500  # GRPO iterations
    c.train.log_every = 5  # metrics cadence
    c.train.eval_every = 50  # exact evaluation cadence
    c.train.checkpoint_every = 500  # checkpoint cadence
    c.train.keep_checkpoints = 1  # checkpoints kept by the CheckpointManager

    c.eval = config_dict.ConfigDict()
    c.eval.pass_k = (1, 4)  # k values for eval/pass_at_k (best token among k samples, exact)

    c.mesh = blocks.mesh_block()  # prompts over data, members over member, as every task's
    c.logging = blocks.logging_block(tensorboard=False)
    # warn when kl > 1.5 (the optimum is far from SFT here) or the reward std stays < 0.3
    c.diagnostics = blocks.diagnostics_block(kl_bound=1.5, reward_std_low=0.3)

    if "tiny" in tokens:
        c.toy.sft.num_steps = 200
        c.toy.rm.num_steps = 200
        c.train.num_steps = 6
        c.train.log_every = 2
        c.train.eval_every = 3
        c.train.checkpoint_every = 3
        c.logging.progress = False
    return c
