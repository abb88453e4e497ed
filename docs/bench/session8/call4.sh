R=$1
set -x
cd /tmp
timeout 150 python3 -m pytest -q -m gpu -c $R/pyproject.toml --rootdir $R -p no:cacheprovider $R/tests/test_kernels_chunk_attention.py 2>&1 | grep -E "passed|failed|FAILED|Mismatch|Max abs|Error" | head -12
timeout 200 python3 -m qwen35_jax.serving.offline_bench --model 4b --context 1024 --compile-cache /tmp/xla --gpu-memory-fraction 0.85 --batches 1,16,32,64 --prefill 1024,8192 --result-json $OUT/engine_final.json 2>&1 | grep -v -e W1202 -e Warn | tail -5
