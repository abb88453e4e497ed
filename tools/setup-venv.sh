#!/usr/bin/env bash
# Creates .venv with a Python 3.12 interpreter (JAX >= 0.11 needs it) and installs the project with the
# server and test extras, pinned to the GPU host's jax/flax by constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
find_python() {
  for candidate in "${PYTHON:-}" python3.12 "$(command -v pyenv >/dev/null 2>&1 && PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null)" \
      "$HOME/.pyenv/versions/3.12.1/bin/python3.12" /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  for dir in "$HOME"/.pyenv/versions/3.12*/bin; do
    [ -x "$dir/python3.12" ] && { echo "$dir/python3.12"; return 0; }
  done
  echo "no Python 3.12 interpreter found: install one or set PYTHON=/path/to/python3.12" >&2
  return 1
}
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  py=$(find_python)
  echo "creating .venv with $py"
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e ".[serve,dev]"
