#!/bin/bash
# The HTTP runs against one live `qwen35-jax serve`: 1024/256 at concurrency 1 and 16, then
# 1024/128 at a Poisson rate of 16 requests/s, each writing its JSON result into OUTDIR; the server's log too.
#
#   tools/server_bench_runs.sh OUTDIR --model 4b --kernels pallas --max-batch 32 --gpu-memory-fraction 0.6
#
# Everything after OUTDIR goes to `serve`. Exits non-zero if the server does not come up or a run fails.
# Request counts are small enough for a 10-minute GPU lease: 8 requests at concurrency 1, 48 at 16, 96 at QPS 16.
set -u
out=${1:?usage: tools/server_bench_runs.sh OUTDIR SERVE_FLAGS...}
shift
mkdir -p "$out"
port=8011
python3 -m qwen35_jax.cli serve --port "$port" "$@" >"$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
get() { python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())" "$1" 2>/dev/null; }
for _ in $(seq 600); do
  get "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 $server 2>/dev/null || { echo "server exited"; tail -n 30 "$out/server.log"; exit 1; }
  sleep 1
done
get "http://127.0.0.1:$port/health" >/dev/null || { echo "server not up in 600 s"; exit 1; }
grep -E "compiled|caches|listening|loaded" "$out/server.log" | tail -n 5

bench() {
  local label=$1
  shift
  python3 -m qwen35_jax.serving.bench --base-url "http://127.0.0.1:$port" --label "$label" --quiet \
    --result-json "$out/$label.json" "$@" || return 1
}
status=0
bench c1_1024_256 --input-len 1024 --output-len 256 --num-prompts 8 --max-concurrency 1 || status=1
bench c16_1024_256 --input-len 1024 --output-len 256 --num-prompts 48 --max-concurrency 16 || status=1
bench qps16_1024_128 --input-len 1024 --output-len 128 --num-prompts 96 --request-rate 16 || status=1
get "http://127.0.0.1:$port/metrics" >"$out/metrics.txt"
exit $status
