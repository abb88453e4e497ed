R=$1
set -x
cd /tmp
timeout 150 python3 $R/tools/bench_residual_norm.py --batch 1 16 32 --splits 8 1 --json $OUT/residual_norm.json 2>&1 | grep -v -e W1202 -e Warn | tail -8
