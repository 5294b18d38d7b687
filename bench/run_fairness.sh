#!/usr/bin/env bash
# Tenant fairness (issue 28): a heavy tenant at concurrency 32 with 1,024-token prompts and a
# light tenant at 1 req/s with 128-token prompts, the default model, `kvserve bench serve
# --tenants` the client. Per round and per data-parallel size, interleaved: fcfs, fair, fair
# with a 512-token step budget, then the light tenant alone (same prompts and arrivals,
# --tenants-only light) on a fair server.
#
#   bash bench/run_fairness.sh                    # 1 round, DP 1 and 2, the model's dtype
#   ROUNDS=2 DPS="1" DTYPE=bfloat16 bash bench/run_fairness.sh
# Results: one bench JSON per run in OUT_DIR (bench/fairness_report.py summarises them).
# Not part of CI.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
KVSERVE="$ROOT/.venv/bin/kvserve"
ROUNDS="${ROUNDS:-1}"
DPS="${DPS:-1 2}"
DTYPE="${DTYPE:-auto}"
PORT="${PORT:-8031}"
OUT_DIR="${OUT_DIR:-$ROOT/bench/results/fairness-$(date +%Y%m%d-%H%M%S)}"
MIX="${MIX:-heavy:rate=inf,conc=32,input=1024,output=64,num=48;light:rate=1,conc=4,input=128,output=32,num=20}"
mkdir -p "$OUT_DIR"

# SERVER_PID, cleanup (also on exit), log
source "$(dirname "$0")/sitting_server.sh"

serve() {  # serve DP LOG FLAGS...
  local dp=$1 logfile=$2
  shift 2
  "$KVSERVE" serve --port "$PORT" --dtype "$DTYPE" --data-parallel-size "$dp" \
    --tenant-header X-Tenant "$@" >"$logfile" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 450); do
    curl -sf "localhost:$PORT/health" >/dev/null && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || { cat "$logfile" >&2; return 1; }
    sleep 2
  done
  return 1
}

bench() {  # bench NAME EXTRA...
  local name=$1
  shift
  "$KVSERVE" bench serve --port "$PORT" --tenants "$MIX" "$@" --save-result \
    --result-dir "$OUT_DIR" --result-filename "$name.json" >"$OUT_DIR/$name.txt" 2>&1
}

for round in $(seq 1 "$ROUNDS"); do
  for dp in $DPS; do
    for config in fcfs fair fair512; do
      flags=(--scheduling-policy fair)
      case $config in
        fcfs) flags=(--scheduling-policy fcfs) ;;
        fair512) flags+=(--max-num-batched-tokens 512) ;;
      esac
      log "round $round dp $dp $config"
      serve "$dp" "$OUT_DIR/server-r$round-dp$dp-$config.log" "${flags[@]}"
      bench "r$round-dp$dp-$config"
      if [ "$config" = fair ]; then
        log "round $round dp $dp light alone"
        bench "r$round-dp$dp-alone" --tenants-only light
      fi
      cleanup
    done
  done
done
log "results in $OUT_DIR"
