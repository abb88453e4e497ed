"""tools/probe_boundaries.py: the three programs it times compute the same products, and it reports a boundary's
cost for both chains (on a CPU the kernels run in Pallas interpret mode, so only the wiring is checked)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

TOOL = Path(__file__).resolve().parents[1] / "tools" / "probe_boundaries.py"


def _probe():
    spec = importlib.util.spec_from_file_location("probe_boundaries", TOOL)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


def test_the_chains_compute_the_products_they_time():
    single, independent, dependent = _probe().programs(32, interpret=True)
    key = jax.random.key(1)
    x = jax.random.normal(key, (1, 32), jnp.float32)
    weights = [jax.random.normal(jax.random.fold_in(key, i), (64, 32), jnp.float32) for i in range(3)]
    # fp32 operands: the kernel's sums differ from numpy's only by summation order (tolerance 1e-4 relative).
    np.testing.assert_allclose(np.asarray(single(x, [jnp.concatenate(weights)])[0]),
                               np.asarray(x @ jnp.concatenate(weights).T), rtol=1e-4, atol=1e-4)  # fmt: skip
    for got, w in zip(independent(x, weights), weights, strict=True):
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(x @ w.T), rtol=1e-4, atol=1e-4)
    expected = x
    for w in weights:
        expected = (expected @ w.T)[:, :32]
    np.testing.assert_allclose(np.asarray(dependent(x, weights)), np.asarray(expected), rtol=1e-4, atol=1e-3)


def test_the_probe_reports_a_boundary_for_each_chain(tmp_path):
    out = tmp_path / "boundaries.json"
    argv = ["--products", "2", "--out", "64", "--in", "32", "--calls", "2", "--repeats", "1", "--json", str(out)]
    assert _probe().main(argv) == 0
    rows = json.loads(out.read_text())
    for name in ("single_us", "independent_us", "dependent_us"):
        assert rows[name] > 0
    for chain in ("independent", "dependent"):
        assert rows[f"{chain}_boundary_us"] == (rows[f"{chain}_us"] - rows["single_us"])
