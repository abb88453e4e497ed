#!/bin/bash
# Every figure of docs/performance.md's table, measured in one GPU lease, one stage a command (each stage fits a
# 10-minute call). Run the stages in order on the same machine: they share OUTDIR and the compilation cache.
#
#   tools/lease_bench.sh offline OUTDIR   device limits; decode TPOT at batch 1/16/64/256 (context 1024) and
#                                         prefill 1024/8192 through the engine, with their floors
#   tools/lease_bench.sh peer OUTDIR      the HF transformers + fla peer at the same cells (needs torch,
#                                         transformers 5.17 and, for its fast GDN path, flash-linear-attention
#                                         0.6.0; peer.json says which GDN path ran)
#   tools/lease_bench.sh kernels OUTDIR   the GDN chunked prefill kernel against fla at 1k-8k tokens (fla 0.6.0 on the
#                                         PYTHONPATH: flash-linear-attention, fla-core and einops, beside the host's
#                                         torch; without it the kernel runs alone); the greedy pick's two forms at
#                                         1-256 rows
#   tools/lease_bench.sh gate OUTDIR      the bf16 golden gate of the Pallas kernels (needs torch and transformers
#                                         5.17), with the GDN states stored in fp32 and in bf16
#   tools/lease_bench.sh server OUTDIR    `serve --model 4b --max-batch 64` from a cold cache: time to ready, the
#                                         HTTP cells (c1 and c16 1024/256, QPS16 1024/128, 16 x 128 bursts), then
#                                         the same server from the warm cache: time to ready
#   tools/lease_bench.sh bursts OUTDIR    three 16 x 128 bursts against a fresh `serve --model 4b --max-batch 64 --trace-steps`
#                                         on the stage's cache: each request's TTFT and ITLs (http/burst_trace_*.json)
#                                         and the step plans (http/server_bursts.log), to see why the first burst's
#                                         TTFT p50 has been ~20 ms above the next two's
#   tools/lease_bench.sh host OUTDIR      the host's own time a decode step (batch 1; HOST_BATCHES) under each of XLA's
#                                         command buffer update modes, and with command buffers off; XLA's log
#                                         of how many commands each step re-records (OUTDIR/host/*.log)
#   tools/lease_bench.sh report OUTDIR    the table (OUTDIR/table.md) and the two plots (OUTDIR/*.png)
#
# Model: the 4B preset with random bf16 weights (no trained weights exist on the host).
set -euo pipefail
stage=${1:?usage: tools/lease_bench.sh offline|peer|kernels|gate|server|bursts|host|report OUTDIR}
out=${2:?usage: tools/lease_bench.sh STAGE OUTDIR}
here=$(cd "$(dirname "$0")" && pwd)
cache=${QWEN35_JAX_COMPILE_CACHE:-$out/xla-cache}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

wait_ready() {  # port log -> seconds from now until /health answers 200, or exit
  local port=$1 log=$2 start=$SECONDS
  for _ in $(seq 900); do
    python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1])" "http://127.0.0.1:$port/health" \
      2>/dev/null && { echo $((SECONDS - start)); return 0; }
    kill -0 "$server" 2>/dev/null || { echo "server exited" >&2; tail -n 30 "$log" >&2; exit 1; }
    sleep 1
  done
  echo "server not up in 900 s" >&2
  exit 1
}

wait_built() {  # log: until the server's background build is done, so that no step pads up to a larger program
  for _ in $(seq 400); do grep -q "built the other programs in the background" "$1" && return 0; sleep 1; done
}

bench() {  # port label flags...
  local port=$1 label=$2
  shift 2
  python3 -m qwen35_jax.serving.bench --base-url "http://127.0.0.1:$port" --label "$label" --quiet \
    --result-json "$out/http/$label.json" "$@"
}

case $stage in
  offline)
    python3 "$here/device_limits.py" --json "$out/device_limits.json"
    export QWEN35_JAX_DEVICE_LIMITS=$out/device_limits.json  # the floors from this card's own limits
    python3 -m qwen35_jax.serving.offline_bench --model 4b --context 1024 --batches 1,16,64,256 \
      --prefill 1024,8192 --compile-cache "$cache" --result-json "$out/engine.json"
    ;;
  peer)
    python3 "$here/bench_hf_peer.py" --model 4b --batches 1,16,64,256 --context 1024 --prefill 1024,8192 \
      --result-json "$out/peer.json"
    ;;
  kernels)
    JAX_PLATFORMS=cuda python3 "$here/bench_gdn_prefill.py" --tokens 1024 2048 4096 8192 --rows 1 \
      --json "$out/gdn_prefill.json"
    JAX_PLATFORMS=cuda python3 "$here/bench_greedy.py" --batch 1 16 32 64 256 --json "$out/greedy.json"
    ;;
  gate)
    for dtype in float32 bfloat16; do
      python3 "$here/gpu_golden_gate.py" --workdir "$out/gate-work" --kernels pallas --mamba-ssm-cache-dtype "$dtype" \
        --report "$out/gate_pallas_$dtype.json" || echo "the gate with $dtype states failed (see the report)"
    done
    ;;
  server)
    mkdir -p "$out/http"
    port=8031
    flags=(--model 4b --max-batch 64 --port "$port" --compile-cache "$cache")
    python3 -m qwen35_jax.cli -v serve "${flags[@]}" >"$out/http/server_cold.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
    echo "cold_ready_s $(wait_ready $port "$out/http/server_cold.log")" | tee "$out/http/ready.txt"
    wait_built "$out/http/server_cold.log"
    bench $port c1_1024_256 --input-len 1024 --output-len 256 --num-prompts 8 --max-concurrency 1
    bench $port c16_1024_256 --input-len 1024 --output-len 256 --num-prompts 48 --max-concurrency 16
    bench $port qps16_1024_128 --input-len 1024 --output-len 128 --num-prompts 96 --request-rate 16
    for i in 1 2 3; do
      bench $port "burst16x128_$i" --input-len 128 --output-len 16 --num-prompts 16 --max-concurrency 16
    done
    kill $server; wait $server 2>/dev/null || true
    python3 -m qwen35_jax.cli -v serve "${flags[@]}" >"$out/http/server_warm.log" 2>&1 &
    server=$!
    echo "warm_ready_s $(wait_ready $port "$out/http/server_warm.log")" | tee -a "$out/http/ready.txt"
    kill $server; wait $server 2>/dev/null || true  # stopped here, so the stage exits 0 rather than the kill's 143
    trap - EXIT
    ;;
  bursts)
    mkdir -p "$out/http"
    port=8032
    : >"$out/http/server_bursts.log"  # appended to by the server and by the markers between the bursts
    python3 -m qwen35_jax.cli -v serve --model 4b --max-batch 64 --port "$port" --compile-cache "$cache" \
      --trace-steps >>"$out/http/server_bursts.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
    echo "ready_s $(wait_ready $port "$out/http/server_bursts.log")"
    wait_built "$out/http/server_bursts.log"
    for i in 1 2 3; do
      echo "BURST $i" >>"$out/http/server_bursts.log"
      bench $port "burst_trace_$i" --input-len 128 --output-len 16 --num-prompts 16 --max-concurrency 16 --save-detailed
    done
    kill $server; wait $server 2>/dev/null || true
    trap - EXIT
    ;;
  host)
    # The batch-1 step's launch is mostly XLA re-recording its command buffer (a CUDA graph): any command whose
    # buffers moved since the last run is updated, and the step's inputs and outputs are new buffers every step.
    # ALWAYS_UPDATE is XLA's default; SKIP_TEMP keeps the temporary buffer at one virtual address, SKIP_PROFILED
    # every allocation it sees move (both through the VMM allocator); exclusive_lock drops the locking that lets
    # other threads run the same program. Each variant compiles into its own cache. HOST_BATCHES (default 1) sets
    # the batches.
    mkdir -p "$out/host"
    [ -f "$out/device_limits.json" ] && export QWEN35_JAX_DEVICE_LIMITS=$out/device_limits.json
    for mode in ALWAYS_UPDATE SKIP_TEMP SKIP_PROFILED exclusive_lock off; do
      case $mode in
        off) flags=--xla_gpu_enable_command_buffer= ;;
        exclusive_lock) flags=--xla_gpu_require_exclusive_lock=true ;;
        *) flags=--xla_gpu_command_buffer_update_mode=$mode ;;
      esac
      XLA_FLAGS="${XLA_FLAGS:-} $flags" TF_CPP_MIN_LOG_LEVEL=0 \
        TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1,command_buffer_cmd_executor=1,command_buffer_cmd=1 \
        timeout 115 python3 -m qwen35_jax.serving.offline_bench --model 4b --context 1024 \
        --batches "${HOST_BATCHES:-1}" --prefill '' --compile-cache "$out/host/xla-$mode" \
        --result-json "$out/host/$mode.json" >"$out/host/$mode.log" 2>&1 \
        || echo "$mode failed: $(tail -n 3 "$out/host/$mode.log")"
    done
    python3 "$here/host_modes_report.py" "$out/host"
    ;;
  report)
    peer=()
    [ -f "$out/peer.json" ] && peer=(--peer "$out/peer.json")
    python3 "$here/performance_report.py" --ours "$out/engine.json" "${peer[@]}" --table "$out/table.md" \
      --plots "$out/decode_throughput.png" "$out/prefill_ttft.png"
    cat "$out/table.md"
    ;;
  *)
    echo "unknown stage $stage: offline|peer|kernels|gate|server|bursts|host|report" >&2
    exit 2
    ;;
esac
