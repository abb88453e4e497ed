R=$1
set -x
cd /tmp
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_old $R/runs/old/*.whl
timeout 80 python3 -m pytest -q -m gpu -c $R/pyproject.toml --rootdir $R -p no:cacheprovider $R/tests/test_kernels_residual_norm.py 2>&1 | grep -E "passed|failed|FAILED|Mismatch|Max abs|Error" | head -20
A="--model 4b --context 1024 --compile-cache /tmp/xla --gpu-memory-fraction 0.85"
B="python3 -m qwen35_jax.serving.offline_bench $A"
timeout 200 $B --batches 1,16,32,64 --prefill 1024,8192 --result-json $OUT/engine_s9.json 2>&1 | grep -v -e W1202 -e Warn | tail -4
timeout 90 python3 $R/runs/rows64.py $A --batches 32,64 --prefill 1024 --result-json $OUT/engine_rows64.json 2>&1 | grep -v -e W1202 -e Warn | tail -3
PYTHONPATH=/tmp/site_old:$PYTHONPATH timeout 90 $B --batches 1,64 --prefill 1024 --result-json $OUT/engine_548dd8c.json 2>&1 | grep -v -e W1202 -e Warn | tail -3
timeout 70 $B --kernels pallas+add_norm=ref --batches 1 --prefill 1024 --result-json $OUT/engine_add_norm_ref.json 2>&1 | grep -v -e W1202 -e Warn | tail -3
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv
