# sourced: wheels into /tmp/site (once per machine), env for the runs
if [ ! -d /tmp/site/ml_collections ]; then
  DS=$(python3 -c "import pyarrow; print(5 if int(pyarrow.__version__.split('.')[0]) >= 24 else 4)")
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl .whl/ds$DS/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD GRPO_JAX_DATA=$PWD/shared/data/tinyshakespeare.txt PYTHONUNBUFFERED=1
