R=$1
set -x
cd /tmp
timeout 100 python3 -m pytest -q -m gpu -c $R/pyproject.toml --rootdir $R -p no:cacheprovider $R/tests/test_kernels_residual_norm.py $R/tests/test_kernels_linear.py 2>&1 | grep -E "passed|failed|FAILED|Error" | head -8
timeout 210 python3 -m qwen35_jax.serving.offline_bench --model 4b --context 1024 --compile-cache /tmp/xla --gpu-memory-fraction 0.85 --batches 1,16,32,64 --prefill 1024,8192 --result-json $OUT/engine_final.json 2>&1 | grep -v -e W1202 -e Warn | tail -3 | cut -c1-1500
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_fla $R/.whl/fla_core*.whl $R/.whl/flash_linear*.whl $R/.whl/einops*.whl
PYTHONPATH=$PYTHONPATH:/tmp/site_fla timeout 130 python3 $R/tools/bench_gdn_prefill.py --tokens 1024 2048 --block-v 32 --iters 10 --repeats 3 --json $OUT/gdn_prefill_vs_fla.json 2>&1 | grep -v -e W1202 -e Warn | tail -8
