"""Benchmark client for any OpenAI-compatible server, in the manner of `vllm bench serve`.

    python -m qwen35_jax.serving.bench --base-url http://127.0.0.1:8000 --input-len 1024 --output-len 128 \\
        --num-prompts 64 --max-concurrency 16 --result-json a.json
    python -m qwen35_jax.serving.bench compare a.json b.json

Prompts are random token ids (sent to /v1/completions as a list of ids, so every server sees exactly
`--input-len` prompt tokens) and every request asks for `--output-len` tokens with `ignore_eos`. Requests
go out at a Poisson `--request-rate` (inf: all at once), at most `--max-concurrency` in flight. Each is
streamed: TTFT is the time to the first token's chunk, ITL the gaps between chunks, TPOT the decode time per
output token after the first, E2E the whole request.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import sys
import time
from pathlib import Path

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (env OPENAI_API_KEY)")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (ignore_eos)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at once)"
    )
    p.add_argument("--token-id-min", type=int, default=16, help="random prompt ids are drawn from [min, max)")
    p.add_argument("--token-id-max", type=int, default=512, help="must not exceed the model's vocabulary")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="let EOS end a request early")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--label", default=None, help="a name for this run in the result and in `compare`")
    p.add_argument("--result-json", default=None, help="write the result here")
    p.add_argument("--save-detailed", action="store_true",
                   help="also keep each request's TTFT and inter-token gaps in the result (in seconds)")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    sub = p.add_subparsers(dest="bench_command")
    compare = sub.add_parser("compare", help="A/B table of two result files")
    compare.add_argument("a")
    compare.add_argument("b")


class BenchError(ValueError):
    """A bad flag value; the message names the flag."""


def check_arguments(args) -> None:
    checks = [
        (args.input_len >= 1, f"--input-len must be >= 1, got {args.input_len}"),
        (args.output_len >= 1, f"--output-len must be >= 1, got {args.output_len}"),
        (args.num_prompts >= 1, f"--num-prompts must be >= 1, got {args.num_prompts}"),
        (args.max_concurrency is None or args.max_concurrency >= 1,
         f"--max-concurrency must be >= 1, got {args.max_concurrency}"),
        (args.request_rate > 0, f"--request-rate must be > 0, got {args.request_rate}"),
        (0 <= args.token_id_min < args.token_id_max,
         f"--token-id-min/--token-id-max must satisfy 0 <= min < max, got {args.token_id_min}, {args.token_id_max}"),
        (args.timeout > 0, f"--timeout must be > 0, got {args.timeout}"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            raise BenchError(message)


def random_prompts(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(args.token_id_min, args.token_id_max) for _ in range(args.input_len)]
            for _ in range(args.num_prompts)]  # fmt: skip


def _headers(args) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def _model_name(session, args) -> str:
    async with session.get(f"{args.base_url}/v1/models", headers=_headers(args)) as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


async def send_one(session, args, model: str, prompt: list[int]) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": args.temperature,
            "ignore_eos": args.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    data = json.dumps(body).encode()  # before the clock starts: the time is the server's, not the encoder's
    headers = {**_headers(args), "Content-Type": "application/json"}
    result = RequestResult(prompt_len=len(prompt))
    start = time.perf_counter()
    try:
        async with session.post(f"{args.base_url}{args.endpoint}", data=data, headers=headers) as r:
            if r.status != 200:
                result.error = f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:300]}"
                return result
            chunks = await _time_chunks(r, result, start)
            if chunks is None:
                return result
    except Exception as err:  # a failed request is counted, not fatal
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.success = chunks > 0 or result.output_tokens > 0
    if not result.success:
        result.error = "no output"
    return result


async def _time_chunks(response, result: RequestResult, start: float) -> int | None:
    """Reads the SSE stream into `result` (TTFT, ITL, the usage's token count); returns the number of
    chunks that carried a token, or None after an error event (its message is in `result.error`)."""
    last, chunks = start, 0
    async for raw in response.content:  # one line at a time
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            result.error = f"stream error: {event['error'].get('message')}"
            return None
        if event.get("usage"):
            result.output_tokens = event["usage"]["completion_tokens"]
        choices = event.get("choices") or [{}]
        if not choices[0].get("text") and choices[0].get("finish_reason", "") is not None:
            continue  # no token in it: a usage-only chunk, or a finish without text
        now = time.perf_counter()
        if chunks == 0:
            result.ttft = now - start
        else:
            result.itl.append(now - last)
        last, chunks = now, chunks + 1
    return chunks


async def _arrivals(count: int, rate: float, rng: random.Random):
    """Yields request indices at Poisson-process times (all at once for an infinite rate)."""
    for i in range(count):
        yield i
        if math.isfinite(rate) and i + 1 < count:
            await asyncio.sleep(rng.expovariate(rate))


async def run_benchmark(args) -> dict:
    import aiohttp

    prompts = random_prompts(args)
    limit = args.max_concurrency or args.num_prompts
    semaphore = asyncio.Semaphore(limit)
    timeout = aiohttp.ClientTimeout(total=args.timeout, connect=30.0)
    progress = None
    if not args.quiet:
        from tqdm import tqdm

        progress = tqdm(total=args.num_prompts, desc="requests", file=sys.stderr)
    # aiohttp, as `vllm bench serve` uses: httpx's client spent ~3 ms of CPU a request on the 2-core machine
    # against ~0.6 ms, so 16 requests sent at once reached even a server that answers at once over ~50 ms, and
    # the burst's TTFTs measured the client (docs/performance.md).
    connector = aiohttp.TCPConnector(limit=limit)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as client:
        model = args.model or await _model_name(client, args)

        async def limited(prompt):
            async with semaphore:
                result = await send_one(client, args, model, prompt)
            if progress is not None:
                progress.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(prompts), args.request_rate, random.Random(args.seed + 1)):
            tasks.append(asyncio.create_task(limited(prompts[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if progress is not None:
        progress.close()
    return summarize(args, model, results, duration)


def _stats(name: str, values_s: list[float]) -> dict:
    """mean and percentiles in milliseconds."""
    out = {f"mean_{name}_ms": 0.0, **{f"p{p}_{name}_ms": 0.0 for p in PERCENTILES}}
    if not values_s:
        return out
    ordered = sorted(values_s)
    out[f"mean_{name}_ms"] = 1000 * sum(ordered) / len(ordered)
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = 1000 * _percentile(ordered, p)
    return out


def _percentile(ordered: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    position = (len(ordered) - 1) * p / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(args, model: str, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = sorted({r.error for r in results if not r.success})
    summary = {
        "label": args.label, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "base_url": args.base_url,
        "endpoint": args.endpoint, "model": model, "input_len": args.input_len, "output_len": args.output_len,
        "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf", "seed": args.seed,
        "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok), "errors": errors[:10],
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }  # fmt: skip
    summary |= _stats("ttft", [r.ttft for r in ok])
    summary |= _stats("tpot", tpot)
    summary |= _stats("itl", [gap for r in ok for gap in r.itl])
    summary |= _stats("e2el", [r.latency for r in ok])
    if getattr(args, "save_detailed", False):
        summary["ttfts"] = [r.ttft for r in ok]
        summary["itls"] = [r.itl for r in ok]
    return summary


ROWS = [
    ("completed", "completed", "{:.0f}"), ("failed", "failed", "{:.0f}"), ("duration_s", "duration (s)", "{:.2f}"),
    ("request_throughput", "requests/s", "{:.3f}"), ("output_throughput", "output tok/s", "{:.1f}"),
    ("total_token_throughput", "total tok/s", "{:.1f}"),
    *[(f"{kind}_{name}_ms", f"{name.upper()} {kind} (ms)", "{:.2f}")
      for name in ("ttft", "tpot", "itl", "e2el") for kind in ("mean", *(f"p{p}" for p in PERCENTILES))],
]  # fmt: skip


def format_summary(summary: dict) -> str:
    width = max(len(title) for _, title, _ in ROWS)
    lines = [f"{'=' * 20} benchmark {summary.get('label') or ''} {'=' * 20}"]
    lines += [f"{title:<{width}}  {fmt.format(summary[key])}" for key, title, fmt in ROWS if key in summary]
    lines += [f"error: {e}" for e in summary.get("errors", [])]
    return "\n".join(lines)


def format_comparison(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    """A table of every metric of two runs, with B's change relative to A."""
    width = max(len(title) for _, title, _ in ROWS)
    name_a, name_b = a.get("label") or name_a, b.get("label") or name_b
    lines = [f"{'metric':<{width}}  {name_a:>14}  {name_b:>14}  {'B vs A':>9}"]
    for key in ("input_len", "output_len", "num_prompts", "max_concurrency", "request_rate"):
        if a.get(key) != b.get(key):
            lines.append(f"note: {key} differs ({a.get(key)} vs {b.get(key)})")
    for key, title, fmt in ROWS:
        if key not in a or key not in b:
            continue
        change = f"{100 * (b[key] - a[key]) / a[key]:+.1f}%" if a[key] else "-"
        lines.append(f"{title:<{width}}  {fmt.format(a[key]):>14}  {fmt.format(b[key]):>14}  {change:>9}")
    return "\n".join(lines)


def run_command(args) -> None:
    """The `bench` handler: a run, or `compare A B`."""
    if getattr(args, "bench_command", None) == "compare":
        a, b = (json.loads(Path(path).read_text()) for path in (args.a, args.b))
        print(format_comparison(a, b, Path(args.a).stem, Path(args.b).stem))
        return
    check_arguments(args)
    summary = asyncio.run(run_benchmark(args))
    print(format_summary(summary))
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(summary, indent=2) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qwen35_jax.serving.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run_command(args)
    except BenchError as err:
        print(f"bench: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
