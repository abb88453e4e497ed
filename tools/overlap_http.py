"""The HTTP A/B of `--decode-overlap off|stream` and `--scheduler-policy off|auto`: for each configuration, one
`qwen35-jax serve` is started, the cells below run against it with `qwen35_jax.serving.bench`, and the server
stops. A configuration whose folder already holds `done` is skipped, so a run cut by a lease limit resumes.

    python3 tools/overlap_http.py OUTDIR --configs off/off,stream/off,off/auto,stream/auto -- \\
        --model 4b --kernels pallas --max-batch 32 --max-model-len 8704 --gpu-memory-fraction 0.6

A configuration is OVERLAP/POLICY. Everything after `--` goes to every `serve`. On the lent GPU host, write
OUTDIR outside $OUT and tar it into $OUT: a call brings back only a few files. The cells:
  c1_1024_256, c16_1024_256: 1024-token prompts, 256 tokens out, at concurrency 1 (8 requests) and 16 (48);
  qps{8,12,16}_1024_128: 96 requests of 1024/128 at those Poisson rates;
  mixed: 16 decoders of 128/768 at concurrency 16 while six 8192/16 prompts arrive at 1 req/s (both runs keep
  each request's TTFT and inter-token gaps, for the ITL CDF).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CELLS = {
    "c1_1024_256": ["--input-len", "1024", "--output-len", "256", "--num-prompts", "8", "--max-concurrency", "1"],
    "c16_1024_256": ["--input-len", "1024", "--output-len", "256", "--num-prompts", "48", "--max-concurrency", "16"],
    **{f"qps{rate}_1024_128": ["--input-len", "1024", "--output-len", "128", "--num-prompts", "96",
                               "--request-rate", str(rate)] for rate in (8, 12, 16)},
}  # fmt: skip
MIXED_DECODERS = ["--input-len", "128", "--output-len", "768", "--num-prompts", "16", "--max-concurrency", "16"]
MIXED_LONG = ["--input-len", "8192", "--output-len", "16", "--num-prompts", "6", "--request-rate", "1"]


def healthy(root: str) -> bool:
    try:
        return urllib.request.urlopen(f"{root}/health", timeout=2).status == 200
    except OSError:
        return False


def bench(root: str, out: Path, label: str, flags: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "qwen35_jax.serving.bench", "--base-url", root, "--label", label, "--quiet",
               "--result-json", str(out / f"{label}.json"), *flags]  # fmt: skip
    return subprocess.Popen(command)


def run_cells(root: str, out: Path) -> int:
    failed = 0
    for label, flags in CELLS.items():
        failed += bench(root, out, label, flags).wait() != 0
    decoders = bench(root, out, "mixed_decoders", [*MIXED_DECODERS, "--save-detailed"])
    time.sleep(0.5)  # the decoders are admitted first; the long prompts then arrive beside them
    long = bench(root, out, "mixed_long", [*MIXED_LONG, "--save-detailed"])
    failed += (decoders.wait() != 0) + (long.wait() != 0)
    return failed


def run_config(config: str, out: Path, serve_flags: list[str], port: int) -> int:
    overlap, policy = config.split("/")
    out.mkdir(parents=True, exist_ok=True)
    root = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "qwen35_jax.cli", "-v", "serve", "--port", str(port), "--decode-overlap",
               overlap, "--scheduler-policy", policy, *serve_flags]  # fmt: skip
    start = time.perf_counter()
    with open(out / "server.log", "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        while not healthy(root):
            if server.poll() is not None:
                print(f"{config}: server exited with {server.returncode}", flush=True)
                return 1
            time.sleep(1)
        ready = time.perf_counter() - start
        print(f"{config}: ready in {ready:.0f} s", flush=True)
        failed = run_cells(root, out)
        (out / "metrics.txt").write_bytes(urllib.request.urlopen(f"{root}/metrics").read())
        (out / "done").write_text(f"ready_s {ready:.1f}\nfailed_runs {failed}\n")
        return failed
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> int:
    argv = sys.argv[1:]
    serve_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--configs", default="off/off,stream/off,off/auto,stream/auto")
    parser.add_argument("--port", type=int, default=8021)
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    failed = 0
    for config in args.configs.split(","):
        folder = args.out / config.replace("/", "_")
        if (folder / "done").exists():
            print(f"{config}: done already", flush=True)
            continue
        failed += run_config(config, folder, serve_flags, args.port)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
