#!/usr/bin/env bash
# The project's test command: lint, format check, then the whole CPU suite (GPU tests skip themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" .venv/bin/python -m pytest -q "$@"
