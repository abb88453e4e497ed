R=$1
set -x
cd /tmp
A="--model 4b --context 1024 --compile-cache /tmp/xla --gpu-memory-fraction 0.85 --batches 1,32 --prefill 1024"
timeout 80 python3 -m pytest -q -m gpu -c $R/pyproject.toml --rootdir $R -p no:cacheprovider $R/tests/test_kernels_residual_norm.py 2>&1 | grep -E "passed|failed|FAILED|Error" | head -5
timeout 90 python3 $R/runs/ab.py -- $A --result-json $OUT/v1_norm_glu16.json 2>&1 | grep tpot_ms | cut -c1-400
timeout 90 python3 $R/runs/ab.py GLU_EPILOGUE=0 -- $A --result-json $OUT/v2_norm_noglu.json 2>&1 | grep tpot_ms | cut -c1-400
timeout 90 python3 $R/runs/ab.py GLU_EPILOGUE=0 -- $A --kernels pallas+add_norm=ref --result-json $OUT/v3_xla.json 2>&1 | grep tpot_ms | cut -c1-400
timeout 90 python3 $R/runs/ab.py GLU_OUT_BLOCK_N=32 -- $A --result-json $OUT/v4_norm_glu32.json 2>&1 | grep tpot_ms | cut -c1-400
timeout 100 python3 $R/tools/profile_decode.py --batch 1 --compile-cache /tmp/xla --gpu-memory-fraction 0.5 --json $OUT/profile_b1.json 2>&1 | grep -v -e W1202 -e Warn | grep -A30 top_kernels_ms | head -30
