R=$1
set -x
cd /tmp
timeout 240 python3 -m pytest -q -m gpu -c $R/pyproject.toml --rootdir $R -p no:cacheprovider $R/tests/test_kernels_chunk_attention.py 2>&1 | tail -4
timeout 150 python3 $R/runs/prefix_probe.py $R 2>&1 | grep -v -i warn | tail -4
timeout 240 python3 $R/tools/gpu_golden_gate.py --workdir /tmp/gate --kernels ref --report $OUT/gate_ref.json > $OUT/gate_ref_stdout.txt 2>&1; echo "gate ref rc $?"
grep -E '"(check|value|limit|pass)"' $OUT/gate_ref_stdout.txt | paste - - - - | tail -6
