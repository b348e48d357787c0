# A lent GPU machine's setup for experiments/gpu_suite.py, from the repository root.
#
#   bash experiments/gpu_machine.sh download   # here, once: the wheels the GPU image lacks into
#                                              # .whl/, the corpus into shared/data/ (both ignored)
#   source experiments/gpu_machine.sh          # there, at the start of every device call
#
# The image has jax (CUDA), flax, optax, orbax, torch, transformers, accelerate, tokenizers,
# absl and pyarrow, but not ml_collections, tensorboardX, trl or datasets (nor datasets' dill
# and multiprocess), and it cannot reach the internet: the wheels travel with the call (carry
# [".whl", "shared"]). datasets 5.2 wants pyarrow >= 24 and 4.8 wants >= 21, so both are
# downloaded and the machine installs the one its pyarrow allows. The project itself is used
# from the checkout (PYTHONPATH), never pip-installed there, so pip touches none of the
# image's packages.
#
# To check it here at no device time: a Python 3.12 venv with the image's versions (its pip
# list in the device library's KINDS.md: jax 0.11.2, torch 2.11.0, transformers 5.17.0,
# accelerate 1.15.0, huggingface_hub 1.33.0, pyarrow, pandas, xxhash) first on PATH, then
# `source experiments/gpu_machine.sh && python3 experiments/gpu_suite.py --smoke`.

if [ "${1:-}" = download ]; then
  set -e
  exclude=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree
  mkdir -p "$(dirname "$exclude")"
  for path in /.whl/ /shared/; do
    grep -qxF "$path" "$exclude" 2>/dev/null || echo "$path" >> "$exclude"
  done
  D="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64"
  $D -d .whl ml_collections==1.1.0 tensorboardX==2.6.5 trl==1.16.0 dill==0.4.1 \
    multiprocess==0.70.19
  $D -d .whl/ds5 datasets==5.2.0
  $D -d .whl/ds4 datasets==4.8.5
  mkdir -p shared/data
  cp "${GRPO_JAX_DATA:?set GRPO_JAX_DATA to the corpus}" shared/data/tinyshakespeare.txt
  echo "ready: carry [\".whl\", \"shared\"] and source experiments/gpu_machine.sh there"
  exit 0
fi

# sourced on the device: install once per machine (a warm machine keeps /tmp/site)
if [ ! -d /tmp/site/ml_collections ]; then
  DS=$(python3 -c "import pyarrow; print(5 if int(pyarrow.__version__.split('.')[0]) >= 24 else 4)")
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl ".whl/ds$DS"/*.whl || return 1
fi
export PYTHONPATH=/tmp/site:$PWD
export GRPO_JAX_DATA=$PWD/shared/data/tinyshakespeare.txt PYTHONUNBUFFERED=1
