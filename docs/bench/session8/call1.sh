R=$1
set -x
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
python3 -c "import tokamax; print('tokamax ok')" 2>&1 | tail -3
python3 $R/runs/tk_check.py 2048 2>&1 | grep -v Warning | tail -12
python3 $R/tools/bench_attention.py --kernel prefill --chunk 8192 --prefix 0 --dense-baselines --json $OUT/attention_dense_8k.json 2>&1 | grep -v -i warn | tail -30
python3 $R/tools/bench_attention.py --kernel prefill --chunk 1024 2048 --prefix 0 --dense-baselines --json $OUT/attention_dense_1k2k.json 2>&1 | grep -v -i warn | tail -30
