set -o pipefail; T0=$SECONDS
source .gpu_prev/setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/env.txt
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" >> $OUT/env.txt 2>&1
OUT=$OUT TAG=v50k_bf16 DUMP=/tmp/dump50 XLA_FLAGS=--xla_dump_to=/tmp/dump50 timeout 215 \
  python3 .gpu_prev/prof_one.py --reference=policy --kl_estimator=k3 \
  --config=configs/shakespeare.py:exhaustive --batch_size=8 --context_len=100 --horizon=70 \
  --warmup=0 --steps=1 --one_run=50000:2500:25@run --config.model.dtype=bfloat16 2>&1 | tee $OUT/v50k_bf16.log
B=$((578 - (SECONDS - T0)))
echo "suite budget $B s"
mkdir -p /tmp/gpu1
python3 experiments/gpu_suite.py --out_dir=/tmp/gpu1 --budget_s=$B \
  --resume=experiments/results/gpu_suite_nvidia-h200.json 2>&1 | tee $OUT/gpu_suite.log
cp /tmp/gpu1/gpu_suite_* $OUT/
