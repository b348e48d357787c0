# one call, no probe (its matmul-peak loop compiles for minutes on the H200) and no
# benchmark roofline (it times matmuls the same way): V=50,000 in bfloat16 beside the chunked
# V=65/256 (their memory peaks), then the large model alone with what is left
set -o pipefail; T0=$SECONDS; END=${1:-410}
source .gpu_prev/setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/env.txt
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices()[0].device_kind)" >> $OUT/env.txt 2>&1
S="python3 experiments/scaling.py --reference=policy --kl_estimator=k3 --config=configs/shakespeare.py:exhaustive --batch_size=8 --context_len=100 --horizon=70"
( XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 175 $S --warmup=0 --steps=1 \
    --one_run=50000:2500:25@run --config.model.dtype=bfloat16 > $OUT/v50k_bf16.out 2>/tmp/v50k.err
  echo "v50k bf16 rc $? at $((SECONDS - T0)) s"; tail -3 /tmp/v50k.err | cut -c1-300 ) &
( export XLA_PYTHON_CLIENT_PREALLOCATE=false
  timeout 80 $S --warmup=1 --steps=3 --one_run=65:0:13@run > $OUT/v65.out 2>/tmp/v65.err
  echo "v65 rc $? at $((SECONDS - T0)) s"; tail -3 /tmp/v65.err | cut -c1-300
  timeout 90 $S --warmup=1 --steps=3 --one_run=256:0:32@run > $OUT/v256.out 2>/tmp/v256.err
  echo "v256 rc $? at $((SECONDS - T0)) s"; tail -3 /tmp/v256.err | cut -c1-300 ) &
wait
L=$((END - (SECONDS - T0))); echo "large: $L s left"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout $L python3 experiments/benchmark.py \
  --config=configs/shakespeare.py:sampled --config.group.size=16 --config.reference.kind=policy \
  --config.grpo.kl_estimator=k3 --config.reward.terms=match --config.grpo.beta=0.04 \
  --config.train.batch_size=16 --config.grpo.num_iterations=1 --config.model.num_layers=12 \
  --config.model.num_heads=12 --config.model.d_model=768 --config.model.dtype=bfloat16 \
  --config.data.context_len=256 --config.data.horizon=128 --warmup=1 --steps=3 \
  --breakdown_runs=2 --noroofline > $OUT/large.out 2>/tmp/large.err
echo "large rc $? at $((SECONDS - T0)) s"; tail -5 /tmp/large.err | cut -c1-300
cat $OUT/*.out | cut -c1-1500
