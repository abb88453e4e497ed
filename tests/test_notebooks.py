"""Execute the notebooks top to bottom with nbclient; the test fails if any cell raises.

notebooks/accuracy.ipynb compares the engine with the HF goldens and ends in an assert on the gate of docs/accuracy.md, so
this is also the accuracy regression test.

Kernel: nbclient starts the kernelspec named "python3". To make that this interpreter (this venv, where qwen35_jax is
installed) on any machine, a fresh CI box without a kernelspec as well as one whose user-level "python3" spec points
at another Python, the test writes its own "python3" kernelspec (argv: sys.executable -m ipykernel_launcher) into a
temporary folder and puts that folder first on JUPYTER_PATH, which jupyter_client searches before the user, venv and
system kernel folders. Nothing is installed outside the temporary folder.

The kernel inherits the environment, with two defaults (a value the caller set wins):
- JAX_PLATFORMS=cpu (conftest.py's default too): the fp32 limit is for CPU, where fp32 matmuls are exact fp32.
- the session's persistent XLA compilation cache (conftest.py's compile_cache_dir). Nearly all of the notebook's
  time is XLA compiling one program per (case, dtype, 64-token bucket); tests/test_golden.py runs the same full
  prefills earlier in the session (and writes them to that cache once an engine has enabled it), so in a full-suite
  run the kernel loads them instead of compiling. Run alone, the notebook compiles everything (about 90 s of CPU).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


@pytest.fixture
def python3_kernel(tmp_path, monkeypatch, compile_cache_dir):
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (test venv)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    defaults = {
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": compile_cache_dir,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    for key, value in defaults.items():
        if key not in os.environ:
            monkeypatch.setenv(key, value)
    return "python3"


@pytest.mark.parametrize("name", ["accuracy.ipynb"])
def test_notebook_runs(name, python3_kernel):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(
        nb, timeout=600, kernel_name=python3_kernel, resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute()  # raises CellExecutionError (with the cell's traceback) if any cell fails
    # the last cell prints "all gates pass" only after its assert
    last = "".join(o.get("text", "") for o in nb.cells[-1].get("outputs", []) if o.get("output_type") == "stream")
    assert "all gates pass" in last, last
