#!/usr/bin/env bash
# Issue 50's side-by-side: the BERT-base-shaped embedding folder of bench/encoders.py served by
# kvserve and by vLLM-CPU (float32, `--runner pooling`, both), interleaved rounds, the same
# client (bench/encoders.py --embed-url): embedded tokens per second at concurrency 32.
#
#   ROUNDS=2 REQUESTS=64 bash bench/run_encoders_sitting.sh
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
EMBED_DIR=$(cd "$ROOT" && "$PYTHON" -c "import sys; sys.path[:0] = ['bench', '.']
import encoders; print(encoders.build_folders('$WORKDIR')[0])")
bench() {  # bench TAG
  (cd "$ROOT" && "$PYTHON" bench/encoders.py --workdir "$WORKDIR" --skip rerank \
    --embed-url "http://127.0.0.1:$PORT" --requests "$REQUESTS") >"$OUT_DIR/$1.txt" 2>&1
  log "$1: $(grep 'embedded tokens/s' "$OUT_DIR/$1.txt")"
}
for round in $(seq 1 "$ROUNDS"); do
  log "kvserve r$round"
  "$ROOT/.venv/bin/kvserve" serve "$EMBED_DIR" --runner pooling --dtype float32 --port "$PORT" \
    --served-model-name bench --uvicorn-log-level warning >"$OUT_DIR/kvserve_r$round.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy "$OUT_DIR/kvserve_r$round.log"
  bench "kvserve_r$round"
  cleanup
  log "vllm r$round"
  (cd /tmp
   source "$ROOT/bench/vllm_cpu/vllm_cpu_env.sh"
   exec vllm serve "$EMBED_DIR" --runner pooling --dtype float32 --port "$PORT" \
     --served-model-name bench) >"$OUT_DIR/vllm_r$round.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy "$OUT_DIR/vllm_r$round.log"
  bench "vllm_r$round"
  cleanup
done
grep -H "embedded tokens/s" "$OUT_DIR"/*.txt
