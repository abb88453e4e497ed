"""Execute the notebooks top to bottom with nbclient; the test fails if any cell raises.

notebooks/accuracy.ipynb compares the engine with the HF goldens and ends in an assert on the DESIGN §8 gate, so
this is also the accuracy regression test.

Kernel: nbclient starts the kernelspec named "python3". To make that this interpreter (this venv, where qwen35_jax is
installed) on any machine, a fresh CI box without a kernelspec as well as one whose user-level "python3" spec points
at another Python, the test writes its own "python3" kernelspec (argv: sys.executable -m ipykernel_launcher) into a
temporary folder and puts that folder first on JUPYTER_PATH, which jupyter_client searches before the user, venv and
system kernel folders. Nothing is installed outside the temporary folder.

The kernel inherits the environment; JAX_PLATFORMS defaults to cpu there (the goldens and the fp32 limit are for
CPU: a GPU may run fp32 matmuls at reduced precision), unless the caller set it.
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
def python3_kernel(tmp_path, monkeypatch):
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (test venv)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    if "JAX_PLATFORMS" not in os.environ:
        monkeypatch.setenv("JAX_PLATFORMS", "cpu")
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
