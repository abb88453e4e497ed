"""Host-side profile of the engine's decode step on any machine: cProfile over steady decode steps of a model with
a published model's layer structure (--layers, the 4B's 32 by default, so the step program takes as many weight
arrays as the 4B's) and the tiny preset's dimensions, so the device work is negligible next to the host's.

    python tools/profile_host.py --layers 32 --layout per_group --steps 200

Why: on the H200 the batch-1 step's host time (launch + fetch, docs/performance.md) adds up to its TPOT, so the host may now bound batch 1. This says where the host time goes: the engine's Python
(scheduler, inputs, bookkeeping) or the call of the compiled program, whose cost grows with its argument count.
On a CPU the device waits show up under `fetch` (numpy.asarray of the step's tokens).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import time


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (a multiple of the group of 4)")
    parser.add_argument("--layout", default="per_group", choices=("stacked", "per_group"),
                        help="the group weights' layout: per_group is the GPU's (more arrays a step), stacked the CPU's")  # fmt: skip
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=25, help="functions listed, by cumulative time")
    args = parser.parse_args(argv)

    import jax.numpy as jnp

    from qwen35_jax.api import LoadedModel
    from qwen35_jax.config import preset
    from qwen35_jax.model import layout_for_platform
    from qwen35_jax.serving.engine import GenerationParams
    from qwen35_jax.serving.factory import EngineConfig, build_engine
    from qwen35_jax.weights import random_params

    cfg = dataclasses.replace(preset("tiny"), num_hidden_layers=args.layers, layer_types=(), name=f"tiny{args.layers}")
    model = LoadedModel(cfg, random_params(cfg, jnp.float32, 0), jnp.float32, None, "ref")
    if args.layout == "per_group":
        model.params = layout_for_platform(model.params, platform="gpu")
    warmup = 2 * args.batch + 10  # steps until every prompt is in and every row decodes
    max_tokens = warmup + args.steps + 8  # no row finishes inside the profiled steps, whatever the batch
    config = EngineConfig(max_batch=args.batch, max_prefill_tokens=64, max_model_len=40 + args.batch + max_tokens)
    engine = build_engine(model, config)
    print(f"{len(engine.runner._param_leaves)} weight arrays passed to every step program")
    for row in range(args.batch):
        engine.submit(list(range(3 + row, 40 + row)), GenerationParams(max_tokens, ignore_eos=True), lambda o: None)
    for _ in range(warmup):
        engine.step()
    print(f"profiling {args.steps} steps at batch {args.batch} (rows running: {engine.scheduler.num_running})")
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    print(f"{(time.perf_counter() - start) / args.steps * 1e3:.3f} ms a step (under cProfile)")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
