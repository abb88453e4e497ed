#!/usr/bin/env bash
# The project's test command: lint, format check, then the whole CPU suite (GPU tests skip themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# XLA:CPU's LLVM at -O0: the tests' programs are tiny, so compiling them is most of the suite's time and running
# them little (the suite took 11:01 against 15:57 at -O2 on the 2-core machine). Results agree with -O2's to
# fp32 rounding, and programs compared bit for bit are compiled alike.
export XLA_FLAGS="--xla_backend_optimization_level=0 ${XLA_FLAGS:-}"
# Two workers, each taking whole files (so a file's module fixtures, compiled engines mostly, are built once): the
# suite took 10:24 against 12:46-14:04 in one process on the 2-core machine. The files are dealt in the order
# tests/conftest.py gives them, longest first, not xdist's default of the most tests first. `-n 0` after it runs
# in one process; a .venv made before pytest-xdist joined the dev extra runs in one process too
# (tools/setup-venv.sh adds it).
workers=()
.venv/bin/python -c "import xdist" 2>/dev/null && workers=(-n 2 --dist loadfile --no-loadscope-reorder)
JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" .venv/bin/python -m pytest -q "${workers[@]}" "$@"
