R=$1
set -x
cd /tmp
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu --format=csv
timeout 300 python3 -m pytest -q -m gpu -c $R/pyproject.toml --rootdir $R -p no:cacheprovider $R/tests/test_kernels_chunk_attention.py $R/tests/test_kernels_attention.py $R/tests/test_kernels_gdn_prefill.py $R/tests/test_kernels_gdn_decode.py $R/tests/test_kernels_conv1d.py $R/tests/test_kernels_linear.py 2>&1 | grep -E "passed|failed|FAILED|Mismatch|Max abs|Error" | head -30
timeout 140 python3 $R/tools/profile_decode.py --batch 64 --compile-cache /tmp/xla --gpu-memory-fraction 0.5 --json $OUT/profile_b64.json 2>&1 | grep -v -e W1202 -e Warn | tail -40
timeout 110 python3 $R/tools/bench_gdn_prefill.py --tokens 1024 2048 --block-v 32 --output-block-v 64 128 --iters 10 --repeats 3 --json $OUT/gdn_output_block_v.json 2>&1 | grep -v -e W1202 -e Warn | tail -20
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv
