"""The H200's physical limits that every benchmark figure is printed beside (measured on the H200, docs/performance.md)."""

HBM_BYTES_PER_S = 4.3e12  # device-to-device copy
BF16_FLOPS_PER_S = 790e12  # bf16 dense matmul, 8192^3
