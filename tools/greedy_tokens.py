"""Greedy tokens of the tiny models, through the engine (what `serve` runs) and through `load_model().generate()`,
written as JSON: run it on two builds and compare the files to show that a refactor kept every token.

    JAX_PLATFORMS=cpu python tools/greedy_tokens.py tokens.json   # then: cmp a.json b.json

Models: the `tiny` preset and every checkpoint in tests/fixtures/golden, in fp32 and bf16; five prompts of 5-90
tokens, 10 greedy tokens each (ignore_eos), through an engine with 4 decode rows and a 32-token prefill budget, so
that chunked prefill and unified steps both run.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "golden"


def tokens_of(name: str, dtype: str) -> dict[str, list]:
    import numpy as np

    from qwen35_jax.api import load_model
    from qwen35_jax.serving.engine import GenerationParams
    from qwen35_jax.serving.factory import EngineConfig, build_engine

    model = load_model(name, dtype=dtype)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, min(model.config.vocab_size, 500), size=n).tolist() for n in (5, 17, 40, 64, 90)]
    generated = [model.generate(p, 10, ignore_eos=True) for p in prompts[:2]]
    config = EngineConfig(max_batch=4, max_prefill_tokens=32, max_model_len=256, num_pages=96, compile_cache=None)
    engine = build_engine(model, config)
    got = collections.defaultdict(list)
    ids = [engine.submit(p, GenerationParams(max_tokens=10, ignore_eos=True), lambda o: got[o.request_id].extend(o.token_ids))
           for p in prompts]  # fmt: skip
    engine.run_until_done()
    return {"generate": generated, "engine": [got[i] for i in ids]}


def main(argv=None) -> int:
    out = (argv or sys.argv[1:])[0]
    names = ["tiny"] + sorted(str(p) for p in GOLDEN.iterdir() if p.is_dir())
    result = {}
    for name in names:
        for dtype in ("float32", "bfloat16"):
            for path, tokens in tokens_of(name, dtype).items():
                result[f"{os.path.basename(name)}/{dtype}/{path}"] = tokens
            print(name, dtype, flush=True)
    Path(out).write_text(json.dumps(result, indent=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
