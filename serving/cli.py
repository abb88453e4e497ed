"""`qwen35-jax serve` and `qwen35-jax bench`.

`serve` checks every flag, builds the engine config and binds the port before any weight loads, so a bad
flag or a taken port fails in milliseconds with exit code 2 and a message naming the flag. Then: weights
(progress), compilation of every step program (progress), and one line saying where it listens.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from pathlib import Path

from qwen35_jax.cli import FlagError, numerics_flags, resolve_kernels


def add_serving_parsers(subparsers) -> None:
    _serve_parser(subparsers)
    from qwen35_jax.serving import bench

    p = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server (like `vllm bench serve`)")
    bench.add_arguments(p)
    p.set_defaults(handler=_run_bench)


def _run_bench(args) -> None:
    from qwen35_jax.serving import bench

    try:
        bench.run_command(args)
    except bench.BenchError as err:
        raise FlagError(str(err)) from None


def _serve_parser(subparsers) -> None:
    from qwen35_jax.serving.factory import DEFAULT_COMPILE_CACHE, EngineConfig

    defaults = EngineConfig()
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", required=True, help="preset (tiny, 0.8b, 4b, 9b, 27b: random weights) or model folder")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: --model as given)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ routes")
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "headers")):  # fmt: skip
        p.add_argument(flag, default='["*"]', help=f"CORS: the {what} browsers may call from, as a JSON list")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, auth)")
    numerics_flags(p)
    p.add_argument("--max-batch", type=int, default=defaults.max_batch, help="most requests running at once")
    p.add_argument("--max-prefill-tokens", type=int, default=defaults.max_prefill_tokens,
                   help="prompt tokens prefilled per step at most")  # fmt: skip
    p.add_argument("--max-prefill-chunks", type=int, default=None,
                   help="prompts one step may carry, padded within --max-prefill-tokens; beside decode rows, "
                        "prompts of up to --max-prefill-tokens / this many tokens (default: 8; 1 under "
                        "--deterministic)")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=None,
                   help=f"longest prompt + output, in tokens (default: the model's, at most {defaults.max_model_len})")  # fmt: skip
    p.add_argument("--gpu-memory-fraction", type=float, default=defaults.gpu_memory_fraction,
                   help="fraction of free device memory for the KV pool and state slots")  # fmt: skip
    p.add_argument("--num-pages", type=int, default=None, help="KV pool size in pages (default: from memory)")
    p.add_argument("--mamba-ssm-cache-dtype", default=defaults.mamba_ssm_cache_dtype,
                   help="storage of the GDN layers' recurrent states: float32 (HF's precision; auto is float32) or "
                        "bfloat16 (half the state's bytes and slot memory; the math stays fp32)")  # fmt: skip
    p.add_argument("--prompt-logprobs-chunk", type=int, default=None,
                   help="largest chunk of a prompt-logprobs step (echo with logprobs, prompt_logprobs; default: 64, "
                        "at most --max-prefill-tokens); 0: none compiled, such requests get a 400")  # fmt: skip
    p.add_argument("--scheduler-policy", default=defaults.scheduler_policy, help="prefill budget policy: off|auto")
    p.add_argument("--decode-overlap", default=defaults.decode_overlap,
                   help="off|stream: stream runs prefill mixers beside decode mixers on separate GPU streams")  # fmt: skip
    p.add_argument("--overlap-step-bound", type=float, default=defaults.overlap_step_bound,
                   help="stream: a step carrying a prompt chunk costs at most this times the decode-only step")  # fmt: skip
    p.add_argument(
        "--background-compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve once the few programs every step can pad up to are built, and build the rest in the"
        " background (default: on, except with --deterministic or --decode-overlap stream, which build all first)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="every request's tokens and logprobs independent of what shares its batch: decode always runs"
        " the --max-batch program, and prompt chunks run in steps of their own (slower; README)",
    )
    p.add_argument("--max-queue", type=int, default=1024,
                   help="waiting requests beyond --max-batch running; more get HTTP 429")  # fmt: skip
    p.add_argument("--default-chat-max-tokens", type=int, default=4096,
                   help="max_tokens of a chat request that gives none (capped by the context left)")  # fmt: skip
    p.add_argument("--compile-cache", default=str(DEFAULT_COMPILE_CACHE),
                   help="persistent XLA compilation cache folder ('' or 'off' to disable)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of random weights for presets")
    p.add_argument("--trace-steps", action="store_true", help="log every step's plan (ITL_STEP lines)")
    p.add_argument("--reasoning-parser", default="qwen3",
                   help="qwen3: chat answers' <think> blocks go to reasoning_content; none: left in the content")  # fmt: skip
    p.add_argument("--tool-call-parser", default="qwen3_coder",
                   help="qwen3_coder: chat answers' <tool_call> blocks become tool_calls; none: left in the content")  # fmt: skip
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="tool_choice 'none' leaves the tools out of the prompt (by default they are rendered, and the"
                        " answer is not parsed for calls, as in vLLM)")  # fmt: skip
    p.add_argument("--shutdown-timeout", type=float, default=0.0,
                   help="seconds in-flight requests may run on after SIGTERM/SIGINT; then they end with finish_reason"
                        " 'abort' (0: at once)")  # fmt: skip
    p.set_defaults(handler=run_serve)


def engine_config(args, max_position_embeddings: int):
    """The EngineConfig of the serve flags; its own checks name the flags."""
    from qwen35_jax.serving.factory import EngineConfig

    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = min(EngineConfig.max_model_len, max_position_embeddings)
    cache = None if args.compile_cache in ("", "off") else args.compile_cache
    try:
        return EngineConfig(
            max_batch=args.max_batch, max_prefill_tokens=args.max_prefill_tokens, max_model_len=max_model_len,
            max_prefill_chunks=args.max_prefill_chunks,
            gpu_memory_fraction=args.gpu_memory_fraction, num_pages=args.num_pages,
            scheduler_policy=args.scheduler_policy, decode_overlap=args.decode_overlap,
            overlap_step_bound=args.overlap_step_bound, compile_cache=cache,
            prompt_logprobs_chunk=args.prompt_logprobs_chunk, deterministic=args.deterministic,
            background_compile=args.background_compile, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        )  # fmt: skip
    except ValueError as err:
        raise FlagError(str(err)) from None


def model_config(model: str):
    """The model's config (config.json or the preset), read without touching the weights."""
    from qwen35_jax.config import PRESETS, load_config, preset

    if model.lower().removeprefix("qwen3.5-") in PRESETS and not Path(model).exists():
        return preset(model)
    if not Path(model).is_dir():
        raise FlagError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor an existing folder")
    try:
        return load_config(model)
    except Exception as err:
        raise FlagError(f"--model {model}: cannot read its config.json: {err}") from None


def validate_serve(args):
    """Every check that needs no weights; returns (EngineConfig, model config)."""
    resolve_kernels(args)
    if not 0 <= args.port <= 65535:
        raise FlagError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue < 0:
        raise FlagError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.default_chat_max_tokens < 1:
        raise FlagError(f"--default-chat-max-tokens must be >= 1, got {args.default_chat_max_tokens}")
    if args.api_key is not None and not args.api_key.strip():
        raise FlagError("--api-key must not be empty")
    from qwen35_jax.serving.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

    if args.reasoning_parser not in REASONING_PARSERS:
        raise FlagError(f"--reasoning-parser must be {'|'.join(REASONING_PARSERS)}, got {args.reasoning_parser!r}")
    if args.tool_call_parser not in TOOL_CALL_PARSERS:
        raise FlagError(f"--tool-call-parser must be {'|'.join(TOOL_CALL_PARSERS)}, got {args.tool_call_parser!r}")
    if not args.shutdown_timeout >= 0:  # NaN too
        raise FlagError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise FlagError("--served-model-name must not be empty")
    for flag in ("allowed_origins", "allowed_methods", "allowed_headers"):
        setattr(args, flag, _json_strings(getattr(args, flag), "--" + flag.replace("_", "-")))
    cfg = model_config(args.model)
    config = engine_config(args, cfg.max_position_embeddings)
    if config.max_model_len > cfg.max_position_embeddings:
        raise FlagError(f"--max-model-len {config.max_model_len} exceeds the model's max_position_embeddings "
                        f"({cfg.max_position_embeddings})")  # fmt: skip
    return config, cfg


def _json_strings(value, flag: str) -> tuple[str, ...]:
    """A flag given as a JSON list of strings (vLLM's form: '["https://a.example", "https://b.example"]')."""
    if isinstance(value, tuple):  # checked already
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise FlagError(f"{flag} must be a JSON list of strings, such as '[\"*\"]', got {value!r}")
    return tuple(parsed)


class _Elapsed:
    """A progress line for a step with no measurable parts (loading weights): elapsed time, ticking."""

    def __init__(self, description: str):
        from tqdm import tqdm

        self.bar = tqdm(desc=description, total=None, bar_format="{desc}: {elapsed}", file=sys.stderr)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._tick, daemon=True)

    def _tick(self) -> None:
        while not self.done.wait(0.5):
            self.bar.refresh()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.bar.close()


def _compile_progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="compiling step programs", unit="program", file=sys.stderr)


def run_serve(args) -> None:
    config, cfg = validate_serve(args)
    try:
        from qwen35_jax.serving import server as http
    except ImportError as err:
        raise FlagError(f"serve needs the server extras (pip install 'qwen35-jax[serve]'): {err}") from None
    try:
        sock = http.bind(args.host, args.port)
    except OSError as err:
        raise FlagError(f"--host {args.host} --port {args.port}: cannot bind: {err.strerror or err}") from None
    try:
        _serve_on(sock, args, config, cfg)
    finally:
        sock.close()


def _load(args, config):
    from qwen35_jax.api import load_model
    from qwen35_jax.serving.factory import build_engine, enable_compile_cache

    # Before the weights: random weights are drawn by small programs, which the cache also serves on a warm start
    # (3.8 -> 0.6 s for the tiny preset on 2 cores).
    enable_compile_cache(config.compile_cache)
    try:
        with _Elapsed(f"loading weights ({args.model}, {args.dtype})"):
            model = load_model(args.model, dtype=args.dtype, kernels=args.kernels, seed=args.seed)
    except (OSError, ValueError) as err:
        raise FlagError(f"--model {args.model}: {err}") from None
    # The pool sizes and the compile total are always reported at start (INFO of the factory's logger);
    # the per-program compile lines stay behind -v.
    logging.getLogger("qwen35_jax.serving.factory").setLevel(logging.INFO)
    try:
        engine = build_engine(model, config, progress=_compile_progress)
        engine.trace_steps = args.trace_steps
        if args.trace_steps:  # the trace is INFO on the engine's logger, whatever the global level
            logging.getLogger("qwen35_jax.serving.engine").setLevel(logging.INFO)
    except ValueError as err:  # e.g. no room for the KV pool; the message names the flag to change
        raise FlagError(str(err)) from None
    return model, engine


def _serve_on(sock, args, config, cfg) -> None:
    from qwen35_jax.serving import server as http
    from qwen35_jax.serving.factory import freeze_startup_heap

    start = time.perf_counter()
    model, engine = _load(args, config)
    name = args.served_model_name or args.model
    server_config = http.ServerConfig(
        served_model_name=name, max_model_len=config.max_model_len, vocab_size=cfg.vocab_size, api_key=args.api_key,
        max_queue=args.max_queue, default_chat_max_tokens=args.default_chat_max_tokens,
        max_logprobs=config.num_top_logprobs, reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser, prompt_logprobs=config.prompt_logprobs_chunk > 0,
        model_root=args.model, allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
    )  # fmt: skip
    app = http.create_app(http.OpenAIServer(engine, model.tokenizer, server_config))
    url = http.listen_url(sock)

    def announce() -> None:
        print(f"qwen35-jax serving {name} on {url} (ready in {time.perf_counter() - start:.1f}s)", flush=True)

    freeze_startup_heap(engine.runner)
    engine.start()
    try:
        http.UvicornServer(app, on_started=announce, drain_seconds=args.shutdown_timeout,
                           on_drain_timeout=engine.shutdown).run(sockets=[sock])  # fmt: skip
    except KeyboardInterrupt:  # uvicorn shut down cleanly, then re-raised the Ctrl+C it caught
        pass
    finally:
        engine.shutdown()
