#!/usr/bin/env bash
# The server with the radix cache on and off on the four built-in workloads, measured by
# `radixserve bench run` (throughput, TTFT, latency; no warm-up request, cache not flushed). The cache hit
# rate of each run is the difference of the server's Prometheus counters (cached / prompt tokens) before
# and after it.
#
# Usage: benchmarks/bench_server_cache.sh [OUT_DIR]   (default: bench_results/server_cache)
# Starts two servers (ports 30100 and 30101), runs each workload against each in turn, stops them.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench_results/server_cache}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
: > "$OUT/results.jsonl"

declare -A PORT=([on]=30100 [off]=30101)
.venv/bin/radixserve serve --port "${PORT[on]}" --log-level warning > "$OUT/server_on.log" 2>&1 &
PIDS=($!)
.venv/bin/radixserve serve --port "${PORT[off]}" --log-level warning --disable-radix-cache > "$OUT/server_off.log" 2>&1 &
PIDS+=($!)
trap 'kill "${PIDS[@]}" 2>/dev/null; wait' EXIT

for mode in on off; do
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:${PORT[$mode]}/health" > /dev/null && break
    sleep 1
  done
done

counter() {  # counter PORT NAME: the value of radixserve_NAME_total
  curl -s "http://127.0.0.1:$1/metrics" | awk -v n="radixserve_$2_total" '$1 ~ "^"n"[{ ]" || $1 == n {s += $2} END {printf "%d\n", s}'
}

for workload in fewshot multiturn parallel agent; do
  for mode in on off; do
    port=${PORT[$mode]}
    p0=$(counter "$port" prompt_tokens); c0=$(counter "$port" cached_tokens)
    "$PY" -m runtime.cli bench run --url "http://127.0.0.1:$port" --workload "$workload" --concurrency 8 \
      --no-warmup --no-optimum --no-progress --label "cache-$mode" --out "$OUT/run_${workload}_$mode.json"
    p1=$(counter "$port" prompt_tokens); c1=$(counter "$port" cached_tokens)
    echo "{\"workload\": \"$workload\", \"cache\": \"$mode\", \"prompt_tokens\": $((p1 - p0)), \"cached_tokens\": $((c1 - c0))}" \
      >> "$OUT/results.jsonl"
  done
done

"$PY" - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
runs = {}
for wl in ("fewshot", "multiturn", "parallel", "agent"):
    for mode in ("on", "off"):
        runs[(wl, mode)] = json.load(open(f"{out}/run_{wl}_{mode}.json"))["summary"]
hits = {(r["workload"], r["cache"]): r for r in map(json.loads, open(f"{out}/results.jsonl"))}
print("| workload | cache | wall s | req/s | seq/s | out tok/s | TTFT p50 s | TTFT p99 s | hit rate | errors | speed-up |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for (wl, mode), s in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1] == "off")):
    h = hits[(wl, mode)]
    rate = h["cached_tokens"] / h["prompt_tokens"] if h["prompt_tokens"] else 0.0
    speed = runs[(wl, "off")]["wall_s"] / s["wall_s"]
    print(f"| {wl} | {mode} | {s['wall_s']:.1f} | {s['requests_per_s']:.2f} | {s['sequences_per_s']:.2f} | "
          f"{s['output_tok_per_s']:.1f} | {s['ttft_p50_s']:.2f} | {s['ttft_p99_s']:.2f} | {rate:.3f} | "
          f"{s['errors']} | {speed:.2f}x |")
EOF
