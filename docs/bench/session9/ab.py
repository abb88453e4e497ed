"""offline_bench with kernel module constants set from NAME=VALUE arguments before `--` (A/B runs; not a project
entry point). Names: linear.GLU_EPILOGUE, linear.GLU_OUT_BLOCK_N, MAX_ROWS (linear and residual_norm)."""

import sys

import qwen35_jax.kernels.linear as linear
import qwen35_jax.kernels.residual_norm as residual_norm
from qwen35_jax.serving import offline_bench

split = sys.argv.index("--")
for item in sys.argv[1:split]:
    name, value = item.split("=")
    if name == "MAX_ROWS":
        linear.MAX_ROWS = residual_norm.MAX_ROWS = int(value)
    else:
        setattr(linear, name, int(value))
    print("set", name, value, flush=True)
offline_bench.main(sys.argv[split + 1 :])
