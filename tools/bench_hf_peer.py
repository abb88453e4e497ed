"""The HF transformers + flash-linear-attention peer: the same model shapes and the same cells as the engine's
offline benchmark (`qwen35_jax.serving.offline_bench`), run by HF transformers 5.17 in torch, so that both sets of
figures come from one GPU lease.

    python3 tools/bench_hf_peer.py --model 4b --batches 1,16,64 --context 1024 --steps 16 \\
        --prefill 1024,8192 --repeats 3 --result-json peer.json

The model is `Qwen3_5ForCausalLM` (text only) built from the project's preset (`qwen35_jax.config.preset`, mapped
to HF's config by `Qwen35Config.to_hf_text_config`) with HF's own random init, seeded, in `--dtype` on `--device`.

Decode, per batch B: one batched forward of B random prompts of `--context` tokens fills HF's cache (the
`DynamicCache` the model returns), then a manual greedy loop of single-token forwards through that cache: 2
warm-up steps, then `--steps` timed steps. A step is the forward plus the argmax of its logits, synchronised
after each step (as `generate` is, by its stopping check); TPOT is the median step and throughput B / TPOT.
Prefill, per length T: one forward of one random prompt of T tokens with a fresh cache plus the argmax of the
last position's logits, the best and median of `--repeats` runs after one warm-up. Every forward passes
`logits_to_keep=1`, as `generate` does, so no forward computes logits it does not use. The field names are
offline_bench's (`tpot_ms`, `ttft_ms_best`, ...). The JSON is rewritten after every case and one line a case is
printed, so a run stopped by a time limit keeps what it measured; a batch that does not fit in GPU memory is
recorded as {"batch": B, "error": ...} and the run goes on.

Caveats, recorded in the JSON:
  * eager mode ("mode": "eager"): no CUDA graphs and no torch.compile, which is how HF models are usually run;
    the per-step Python and kernel-launch cost is part of HF's figure (the engine's steps are compiled programs).
  * random weights: timing does not depend on the values, but the greedy tokens are meaningless.
  * the Gated DeltaNet path: HF binds each GDN function (chunked prefill, one-token recurrent step, the two
    depthwise convolutions) when `modeling_qwen3_5` is imported, to the package kernel when its package imports
    (flash-linear-attention's `fla.ops.gated_delta_rule`, `causal_conv1d`) and to its slow torch reference
    otherwise. "gdn_path" and "gdn_implementations" say which functions this run actually called; a peer without
    fla is not the fast HF peer.
  * attention is HF's default implementation for this model (recorded as "attn_implementation", normally sdpa)
    and the full-attention KV cache grows by concatenation every step (DynamicCache), as in `generate`.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import json
import platform
import statistics
import sys
import time
from pathlib import Path

# transformers probes for a top-level package named `kernels` (HF hub kernels); the repo's own kernels/ folder
# would shadow it when the repo root is on sys.path. The project is imported as the installed qwen35_jax.
_REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _REPO]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402

from qwen35_jax.config import preset  # noqa: E402
from qwen35_jax.serving.offline_bench import save_json  # noqa: E402

WARMUP_STEPS = 2
TOKEN_ID_LIMIT = 248044  # ordinary BPE ids only, as offline_bench's random prompts
# The module-level functions of modeling_qwen3_5 that HF binds to a package kernel when one imports.
GDN_FUNCTIONS = {
    "chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",  # prefill
    "fused_recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule",  # one-token decode
    "causal_conv1d_fn": "causal_conv1d_fn",
    "causal_conv1d_update": "causal_conv1d_update",
}
PACKAGES = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}


def bound_implementation(wrapper) -> str:
    """The function HF's wrapper calls: `use_kernel_func_from_hub_with_fallback` keeps its choice in the closure
    variable `implementation` (the wrapper's `__wrapped__` is always the torch reference, so it cannot tell)."""
    cells = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__ or (), strict=True))
    if "implementation" not in cells:
        return "unknown"
    impl = cells["implementation"].cell_contents
    return f"{impl.__module__}.{impl.__qualname__}"


def gdn_path() -> dict:
    bound = {name: bound_implementation(getattr(modeling_qwen3_5, attr)) for name, attr in GDN_FUNCTIONS.items()}
    gdn = [bound["chunk_gated_delta_rule"], bound["fused_recurrent_gated_delta_rule"]]
    if all(impl.startswith("fla.") for impl in gdn):
        path = "fla"
    elif all(impl.startswith(modeling_qwen3_5.__name__) for impl in gdn):
        path = "torch fallback"
    else:
        path = "mixed"
    return {"gdn_path": path, "gdn_implementations": bound}


def package_probe(module: str, distribution: str) -> dict:
    """Whether `module` imports here (HF's own test) and its installed version, or the import error."""
    try:
        importlib.import_module(module)
    except Exception as e:  # HF falls back on any exception, not only ImportError
        return {f"{module}_importable": False, f"{module}_import_error": f"{type(e).__name__}: {e}"}
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        version = getattr(sys.modules[module], "__version__", None)
    return {f"{module}_importable": True, f"{module}_version": version}


def environment(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    for module, distribution in PACKAGES.items():
        info.update(package_probe(module, distribution))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30, cuda=torch.version.cuda)
    else:
        info.update(cpu=platform.processor() or platform.machine(), torch_threads=torch.get_num_threads())
    return info


def build_model(name: str, dtype: torch.dtype, device: torch.device, seed: int):
    """HF's random init, made in `dtype` on `device` (an fp32 model cast afterwards would need twice the memory)."""
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(**preset(name).to_hf_text_config())
    with device:
        model = Qwen3_5ForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


def random_tokens(gen: torch.Generator, rows: int, length: int, vocab: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, min(vocab, TOKEN_ID_LIMIT), (rows, length), generator=gen).to(device)


def timed(device: torch.device, fn, *args):
    """(seconds, fn(*args)) with the device's work done: CUDA events around it on the GPU, where the host would
    otherwise return before the kernels finish; the wall clock on the CPU, where torch runs synchronously."""
    if device.type != "cuda":
        start = time.perf_counter()
        out = fn(*args)
        return time.perf_counter() - start, out
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn(*args)
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3, out


def prefill(model, ids: torch.Tensor, chunk: int):
    """(greedy next tokens [rows], cache) after `ids` [rows, T], in forwards of `chunk` tokens through HF's cache."""
    cache = None
    for start in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, start : start + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
    return out.logits[:, -1].argmax(-1), cache


def decode_step(model, tokens: torch.Tensor, cache):
    out = model(input_ids=tokens[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].argmax(-1), out.past_key_values


def bench_decode(model, batch: int, context: int, steps: int, chunk: int, gen, device) -> dict:
    ids = random_tokens(gen, batch, context, model.config.vocab_size, device)
    prefill_s, (tokens, cache) = timed(device, prefill, model, ids, chunk)
    times = []
    for _ in range(WARMUP_STEPS + steps):
        seconds, (tokens, cache) = timed(device, decode_step, model, tokens, cache)
        times.append(seconds)
    steady = times[WARMUP_STEPS:]
    tpot = statistics.median(steady)
    return {
        "batch": batch, "context": context, "steps_measured": len(steady), "tpot_ms": tpot * 1e3,
        "tpot_p90_ms": float(np.percentile(steady, 90)) * 1e3, "throughput_tok_s": batch / tpot,
        "prefill_ms": prefill_s * 1e3, "prefill_chunk": chunk, "cache": type(cache).__name__,
    }  # fmt: skip


def bench_prefill(model, tokens: int, repeats: int, gen, device) -> dict:
    ids = random_tokens(gen, 1, tokens, model.config.vocab_size, device)
    timed(device, prefill, model, ids, tokens)  # warm-up: first-call allocations, Triton autotuning
    times = [timed(device, prefill, model, ids, tokens)[0] for _ in range(repeats)]
    best = min(times)
    return {
        "tokens": tokens, "ttft_ms_best": best * 1e3, "ttft_ms_median": statistics.median(times) * 1e3,
        "throughput_tok_s": tokens / best,
    }  # fmt: skip


def guarded(device: torch.device, key: str, value: int, fn, *args) -> dict:
    """fn(*args), or {key: value, "error": ...} when it runs out of GPU memory; the peak memory it used either way."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        row = fn(*args)
    except torch.cuda.OutOfMemoryError as e:
        row = {key: value, "error": f"OutOfMemoryError: {str(e).splitlines()[0]}"}
    # Outside the handler, so that the traceback's frames (and their tensors) are gone before the cache is freed.
    gc.collect()
    if device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.empty_cache()
    return row


def record(result: dict, section: str, row: dict, path: str | None) -> None:
    result[section].append(row)
    print(json.dumps({section: row}), flush=True)
    save_json(path, result)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="4b", help="a qwen35_jax.config preset: tiny, 0.8b, 4b, 9b, 27b")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens of every decode row")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps, after 2 warm-up steps")
    parser.add_argument("--prefill", default="1024,8192", help="prompt lengths of the prefill cells")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each prefill, after one warm-up")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="fill the decode cache in forwards of this many tokens (default: the whole prompt at "
                             "once); the decode steps are the same either way")  # fmt: skip
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    start = time.perf_counter()
    model = build_model(args.model, dtype, device, args.seed)
    result = {
        "model": args.model, "mode": "eager", "weights": "random (HF init, seeded)", "dtype": args.dtype,
        "device": args.device, "seed": args.seed,
        "parameters": sum(p.numel() for p in model.parameters()), "build_s": time.perf_counter() - start,
        "attn_implementation": model.config._attn_implementation, "logits_to_keep": 1,
        "decode_warmup_steps": WARMUP_STEPS, "prefill_warmup_runs": 1,
        "argv": sys.argv[1:] if argv is None else list(argv),
        **environment(device), **gdn_path(),
    }  # fmt: skip
    print(json.dumps(result), flush=True)
    result["decode"], result["prefill"] = [], []
    save_json(args.result_json, result)
    gen = torch.Generator().manual_seed(args.seed)
    with torch.inference_mode():
        chunk = args.prefill_chunk or args.context
        for batch in (int(b) for b in args.batches.split(",")):
            row = guarded(
                device, "batch", batch, bench_decode, model, batch, args.context, args.steps, chunk, gen, device
            )
            record(result, "decode", row, args.result_json)
        for tokens in (int(t) for t in args.prefill.split(",")):
            row = guarded(device, "tokens", tokens, bench_prefill, model, tokens, args.repeats, gen, device)
            record(result, "prefill", row, args.result_json)


if __name__ == "__main__":
    main()
