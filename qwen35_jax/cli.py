"""`qwen35-jax` command line: generate, convert (and the subcommands the serving package adds).

Every flag is validated before any weight is loaded, so a typo costs milliseconds, not a model load.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from qwen35_jax.api import DTYPES, default_kernels
from qwen35_jax.kernels import KERNEL_SETS, check_selectable


class FlagError(ValueError):
    """A bad flag value or combination; the message names the flags."""


def numerics_flags(parser: argparse.ArgumentParser) -> None:
    """--dtype and --kernels, as every command that loads a model takes them (resolve with `resolve_kernels`)."""
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument(
        "--kernels",
        default=None,
        choices=KERNEL_SETS,
        help="token-mixer kernel set (default: pallas on a GPU, ref elsewhere)",
    )


def resolve_kernels(args) -> None:
    """args.kernels: the platform's default when not given; FlagError unless it runs here."""
    try:
        args.kernels = args.kernels or default_kernels()
        check_selectable(args.kernels)
    except ValueError as err:
        raise FlagError(str(err)) from err


def _model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="preset (tiny, 0.8b, 4b, 9b, 27b) or model folder")
    numerics_flags(parser)


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    _model_flags(p)
    p.add_argument("--prompt", default="Hello", help="text prompt (needs a tokenizer)")
    p.add_argument("--token-ids", default=None, help="comma-separated token ids instead of --prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)


def _convert_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert an HF safetensors folder to an orbax checkpoint folder")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen35-jax", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _convert_parser(sub)
    try:
        from qwen35_jax.serving.cli import add_serving_parsers
    except ImportError:  # the server's extra dependencies are not installed
        add_serving_parsers = None
    if add_serving_parsers is not None:
        add_serving_parsers(sub)
    return parser


def _check_model_flag(model: str) -> None:
    from qwen35_jax.config import PRESETS

    if model.lower().removeprefix("qwen3.5-") in PRESETS or Path(model).is_dir():
        return
    raise FlagError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor an existing folder")


def validate_generate(args) -> None:
    _check_model_flag(args.model)
    if args.max_new_tokens < 1:
        raise FlagError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise FlagError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise FlagError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise FlagError(f"--top-k must be >= 0, got {args.top_k}")
    resolve_kernels(args)


def run_generate(args) -> None:
    validate_generate(args)
    from qwen35_jax.api import load_model

    model = load_model(args.model, dtype=args.dtype, kernels=args.kernels, seed=args.seed)
    if args.token_ids:
        ids = [int(t) for t in args.token_ids.split(",")]
    elif model.tokenizer is None:
        raise FlagError(f"{args.model} has no tokenizer: pass --token-ids")
    else:
        text = args.prompt
        if args.chat:
            text = model.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        ids = model.tokenizer.encode(text)
    start = time.perf_counter()
    out = model.generate(ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, seed=args.seed)  # fmt: skip
    elapsed = time.perf_counter() - start
    text = model.tokenizer.decode(out) if model.tokenizer else None
    print(json.dumps({"prompt_tokens": len(ids), "output_ids": out, "text": text, "seconds": round(elapsed, 3)}))


def run_convert(args) -> None:
    src = Path(args.src)
    if not src.is_dir():
        raise FlagError(f"convert: SRC {src} is not a folder")
    from qwen35_jax.api import load_params, resolve_dtype
    from qwen35_jax.config import load_config
    from qwen35_jax.weights import save_orbax

    cfg = load_config(src)
    start = time.perf_counter()
    params = load_params(src, cfg, resolve_dtype(args.dtype))
    raw_config = json.loads((src / "config.json").read_text())
    save_orbax(params, raw_config, args.dst, args.dtype)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (src / name).is_file():
            (Path(args.dst) / name).write_bytes((src / name).read_bytes())
    print(f"converted {src} -> {args.dst} ({args.dtype}) in {time.perf_counter() - start:.1f}s")


COMMANDS = {"generate": run_generate, "convert": run_convert}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    handler = COMMANDS.get(args.command) or getattr(args, "handler", None)
    try:
        handler(args)
    except FlagError as err:
        print(f"qwen35-jax {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
