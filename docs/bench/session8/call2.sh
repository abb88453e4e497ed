R=$1
set -x
cd /tmp
timeout 240 python3 -m pytest -q -m gpu -c $R/pyproject.toml --rootdir $R -p no:cacheprovider $R/tests/test_kernels_chunk_attention.py 2>&1 | tail -8
timeout 200 python3 $R/tools/bench_attention.py --kernel prefill --chunk 1024 8192 --prefix 0 --json $OUT/attention_split_prefix0.json 2>&1 | grep -v -i warn | tail -6
timeout 120 python3 $R/tools/bench_attention.py --kernel prefill --chunk 1024 --prefix 7168 --json $OUT/attention_split_prefix7168.json 2>&1 | grep -v -i warn | tail -4
timeout 200 python3 -m qwen35_jax.serving.offline_bench --model 4b --context 1024 --compile-cache /tmp/xla --gpu-memory-fraction 0.85 --batches 1 --prefill 1024,8192 --result-json $OUT/engine_split.json 2>&1 | grep -v -e W1202 -e Warn | tail -8
timeout 200 python3 $R/tools/gpu_golden_gate.py --workdir /tmp/gate --kernels pallas --report $OUT/gate_pallas.json > $OUT/gate_stdout.txt 2>&1; echo "gate rc $?"
grep -E '"(check|value|limit|pass)"' $OUT/gate_stdout.txt | paste - - - - | tail -6
tail -5 $OUT/gate_stdout.txt
