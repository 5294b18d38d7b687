#!/usr/bin/env bash
# Issue 46's sitting: serving to latency targets, kvserve beside vLLM-CPU, one client
# (`kvserve bench serve`), the same workloads, interleaved rounds on one machine.
#
#   bash bench/run_slo_sitting.sh                       # 2 rounds, targets from a calibration
#   CALIBRATE=1 SHORT_TTFT_MS=400 bash ...             # calibrate anyway (run when a target is unset)
#   SHORT_TTFT_MS=400 SHORT_TPOT_MS=60 RATE=3 bash bench/run_slo_sitting.sh
#   PARTS=c LIGHT_TTFT_MS=760 SHORT_TTFT_MS=1343 SHORT_TPOT_MS=127 bash ...  # (c), its own target
#   KVSERVE_ONLY=1 ROUNDS=1 DURATION=5 bash bench/run_slo_sitting.sh   # a smoke test
#
# Servers (float32, the same KV budget KV_CACHE_GIB, --max-model-len MAX_MODEL_LEN: 8,192, the
# default model's whole context, which an 8,000-token document and its token fit in; 8,400
# would be past what SmolLM2-135M allows, in kvserve and in vLLM):
#   vllm     vLLM-CPU 0.32 from VCPU_VENV (bench/run_vllm_cpu.sh installs it), model VCPU_MODEL;
#   fcfs     kvserve, fcfs, no targets: the client sends no x-slo-* header
#            (`--no-target-headers`, goodput still judged against the same targets);
#   slo      kvserve with targets: the same server process as fcfs (kvserve has no target
#            unless a request carries one), the client sending the targets as the
#            x-slo-ttft-ms / x-slo-tpot-ms headers on the targeted class's requests only
#            (no server default --slo-ttft-ms / --slo-tpot-ms: those would give the long
#            documents the short chats' targets);
#   fairslo  kvserve --scheduling-policy fair, the light tenant's TTFT target in the key file
#            (and as a header), so the engine knows it before a light request arrives (part c);
#   before / after (part d): BEFORE_KVSERVE (a kvserve built from the code before latency
#            targets; default this checkout's, plain) vs this checkout with the targets' code
#            path on and no target set (--slo-admission reject: every request is checked
#            against the TTFT estimate, none has a target).
# vLLM gets the same headers as slo (it ignores them), so both see the same requests.
#
# Parts, each round, each server in turn:
#   (a) the two-class workload: Poisson arrivals at RATE req/s for DURATION s of short chats
#       (128 in / 64 out) and long documents (4,096 in / 64 out), 9 to 1; the short class's
#       targets SHORT_TTFT_MS / SHORT_TPOT_MS (defaults: an unloaded calibration on kvserve,
#       short-class P50 TTFT x 5 and P50 TPOT x 3, run with CALIBRATE=1 or when no targets
#       are known); goodput and per-class P50/P99 TTFT, TPOT, ITL;
#   (b) CHAT_STREAMS chat streams (128 in / CHAT_OUTPUT out, TPOT target SHORT_TPOT_MS) alone,
#       then again with one 8,000-token document sent DOC_DELAY_S after the server runs
#       them all (built before they start, sent by curl: no client process starts beside
#       them, bench/slo_sitting/document_body.py): their ITL P99 each time;
#   (c) issue 28's tenants: heavy at concurrency 32 with 1,024-token prompts, light at 1 req/s
#       with 128-token prompts (TTFT target LIGHT_TTFT_MS under fairslo; default
#       SHORT_TTFT_MS, which is ~3.5x the light tenant's P99 alone: a user who wants "within
#       2x of alone" states about 2x that P99, e.g. LIGHT_TTFT_MS=760 for 382 ms alone); the
#       light tenant's P99 TTFT beside heavy and alone (the same prompts and arrivals), for
#       fcfs, fairslo and vLLM;
#   (d) no targets at concurrency 32, 256 in / 128 out: output tok/s, before vs after.
# Output: OUT_DIR/{part}_{server}_r{round}_{run}.json per run (and .txt, the printed report),
# the servers' logs, targets.env, and summary.md (bench/slo_sitting/summarize.py: median and
# range over rounds, ratios taken within a round). Not part of CI.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
KVSERVE="$ROOT/.venv/bin/kvserve"
PYTHON="$ROOT/.venv/bin/python"
BEFORE_KVSERVE="${BEFORE_KVSERVE:-}"

export VCPU_VENV="${VCPU_VENV:-/tmp/vllm-cpu-venv}"
export VCPU_MODEL="${VCPU_MODEL:-/tmp/smollm2-135m}"
ROUNDS="${ROUNDS:-2}"
DTYPE=float32
MAX_MODEL_LEN="${MAX_MODEL_LEN:-8192}"       # the model's whole context (SmolLM2: 8,192)
KV_CACHE_GIB="${KV_CACHE_GIB:-4}"           # vLLM's VLLM_CPU_KVCACHE_SPACE; kvserve gets the same
PORT="${PORT:-8041}"
OUT_DIR="${OUT_DIR:-$ROOT/bench/results/slo_sitting-$(date +%Y%m%d-%H%M%S)}"
KVSERVE_ONLY="${KVSERVE_ONLY:-}"
KVSERVE_ARGS="${KVSERVE_ARGS:-}"             # extra `kvserve serve` flags, every kvserve server
CALIBRATE="${CALIBRATE:-}"
PARTS="${PARTS:-a b c d}"
# (a) Defaults sized so that 2 rounds of every part fit in about 25 minutes on the 2-core
# machine of bench/RESULTS.md; RATE should be where vLLM-CPU meets about half the targets.
RATE="${RATE:-2}"
DURATION="${DURATION:-40}"
# (b)
CHAT_STREAMS="${CHAT_STREAMS:-4}"
CHAT_OUTPUT="${CHAT_OUTPUT:-128}"
DOC_LEN="${DOC_LEN:-8000}"
DOC_DELAY_S="${DOC_DELAY_S:-2}"
# (c)
HEAVY_NUM="${HEAVY_NUM:-32}"
LIGHT_NUM="${LIGHT_NUM:-12}"
# (d)
C32_PROMPTS="${C32_PROMPTS:-64}"
export KVSERVE_NATIVE_DECODE_ROWS="${KVSERVE_NATIVE_DECODE_ROWS:-128}"

# SERVER_PID, cleanup (also on exit), log, wait_healthy
source "$(dirname "$0")/sitting_server.sh"
wants() { [[ " $PARTS " == *" $1 "* ]]; }

start_kvserve() {  # start_kvserve NAME BINARY FLAGS...: a kvserve server on PORT
  local name=$1 binary=$2
  shift 2
  log "$name: starting kvserve"
  # shellcheck disable=SC2086
  "$binary" serve "$VCPU_MODEL" --host 127.0.0.1 --port "$PORT" --dtype "$DTYPE" \
    --max-model-len "$MAX_MODEL_LEN" --kv-cache-memory "${KV_CACHE_GIB}G" \
    --tenant-header X-Tenant --uvicorn-log-level warning $KVSERVE_ARGS "$@" \
    >"$OUT_DIR/$name.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy "$OUT_DIR/$name.log"
}

start_vllm() {  # start_vllm NAME
  log "$1: starting vLLM-CPU (torch.compile)"
  # The vLLM environment stays in this subshell, outside the repository (vLLM would import
  # this checkout's modules otherwise).
  (cd /tmp
   export VLLM_CPU_KVCACHE_SPACE="$KV_CACHE_GIB"
   source "$ROOT/bench/vllm_cpu/vllm_cpu_env.sh"
   export VLLM_SERVER_DEV_MODE=1  # its POST /reset_prefix_cache
   exec vllm serve "$VCPU_MODEL" --host 127.0.0.1 --port "$PORT" --dtype "$DTYPE" \
     --max-model-len "$MAX_MODEL_LEN") >"$OUT_DIR/$1.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy "$OUT_DIR/$1.log"
}

bench() {  # bench TAG FLAGS...: one `kvserve bench serve` run, its JSON and report in OUT_DIR
  local tag=$1
  shift
  # Every run starts from an empty prefix cache: the fcfs and slo runs of a round send the
  # same prompts to one server, and the second would hit the first's blocks. (Refused, and
  # ignored, while requests run: part b's document joins streams already running.)
  curl -s -o /dev/null -X POST "http://127.0.0.1:$PORT/reset_prefix_cache" || true
  "$KVSERVE" bench serve --base-url "http://127.0.0.1:$PORT" --tokenizer "$VCPU_MODEL" \
    --ignore-eos --disable-tqdm --percentile-metrics ttft,tpot,itl,e2el \
    --metric-percentiles 50,90,99 --save-result --result-dir "$OUT_DIR" \
    --result-filename "$tag.json" --label "$tag" "$@" >"$OUT_DIR/$tag.txt" 2>&1
}

calibrate() {  # the short class unloaded on kvserve: P50 TTFT x 5, P50 TPOT x 3
  start_kvserve calibration "$KVSERVE"
  log "calibration: short chats (128 in / 64 out) one at a time"
  bench calibration --dataset-name random --random-input-len 128 --random-output-len 64 \
    --num-prompts 16 --max-concurrency 1 --seed 100
  cleanup
  "$PYTHON" - "$OUT_DIR/calibration.json" >"$OUT_DIR/calibration.env" <<'EOF'
import json, sys
result = json.load(open(sys.argv[1]))
print(f"CALIBRATED_TTFT_MS={5 * result['median_ttft_ms']:.0f}")
print(f"CALIBRATED_TPOT_MS={3 * result['median_tpot_ms']:.0f}")
EOF
  # shellcheck disable=SC1091
  source "$OUT_DIR/calibration.env"
  log "calibrated: TTFT $CALIBRATED_TTFT_MS ms, TPOT $CALIBRATED_TPOT_MS ms"
}

targets_flags() {  # targets_flags SERVER: the client's flags for the servers without targets
  if [ "$1" = fcfs ]; then echo "--no-target-headers"; fi
}

part_a() {  # part_a SERVER ROUND
  local num
  num=$(awk "BEGIN { n = int($RATE * $DURATION + 0.5); print (n < 1) ? 1 : n }")
  log "$1 r$2: (a) two-class workload, $num requests at $RATE req/s"
  # shellcheck disable=SC2046
  bench "a_$1_r$2_mixed" --dataset-name mixed --num-prompts "$num" --request-rate "$RATE" \
    --mix "short:128:64:0.9:ttft=$SHORT_TTFT_MS:tpot=$SHORT_TPOT_MS,long:4096:64:0.1" \
    --seed "$((10 + $2))" $(targets_flags "$1")
}

part_b() {  # part_b SERVER ROUND: chat streams alone, then beside one long document
  local chat=(--dataset-name mixed --mix "chat:128:$CHAT_OUTPUT:1:tpot=$SHORT_TPOT_MS"
              --num-prompts "$CHAT_STREAMS" --max-concurrency "$CHAT_STREAMS")
  log "$1 r$2: (b) $CHAT_STREAMS chat streams alone"
  # shellcheck disable=SC2046
  bench "b_$1_r$2_alone" "${chat[@]}" --seed "$((20 + $2))" $(targets_flags "$1")
  log "$1 r$2: (b) $CHAT_STREAMS chat streams, a $DOC_LEN-token document after ${DOC_DELAY_S} s"
  # The document's body is built first and sent with curl once the streams run: a client
  # process started beside them would take the engine's cores while they decode.
  local body="$OUT_DIR/b_$1_r$2_document.body.json"
  "$PYTHON" "$ROOT/bench/slo_sitting/document_body.py" --tokenizer "$VCPU_MODEL" \
    --model "$VCPU_MODEL" --len "$DOC_LEN" --seed "$((40 + $2))" --out "$body" >/dev/null
  # shellcheck disable=SC2046
  bench "b_$1_r$2_doc" "${chat[@]}" --seed "$((30 + $2))" $(targets_flags "$1") &
  local chats=$!
  wait_running "$CHAT_STREAMS"
  sleep "$DOC_DELAY_S"
  curl -s -o "$OUT_DIR/b_$1_r$2_document.json" -H "Content-Type: application/json" \
    -w "document: HTTP %{http_code} in %{time_total} s\n" -d "@$body" \
    "http://127.0.0.1:$PORT/v1/completions" >"$OUT_DIR/b_$1_r$2_document.txt"
  wait "$chats"
}

wait_running() {  # wait_running N: until the server runs N requests (its /metrics), 60 s at most
  local _ running
  for _ in $(seq 600); do
    running=$(curl -s "http://127.0.0.1:$PORT/metrics" \
      | awk '/^(kvserve|vllm):num_requests_running[{ ]/ { n += $NF } END { print int(n) }')
    [ "${running:-0}" -ge "$1" ] && return 0
    sleep 0.1
  done
  log "the server never ran $1 requests at once"
}

part_c() {  # part_c SERVER ROUND
  local light_target="" heavy_key="" light_key=""
  [ "$1" = fcfs ] || light_target=",ttft=$LIGHT_TTFT_MS"
  # fairslo's key file gives the light tenant its target (tenants_key_file): the keys name
  # the tenants there (the X-Tenant header names the same ones).
  [ "$1" = fairslo ] && heavy_key=",key=sk-heavy" && light_key=",key=sk-light"
  local mix="heavy:rate=inf,conc=32,input=1024,output=64,num=$HEAVY_NUM$heavy_key"
  mix+=";light:rate=1,conc=4,input=128,output=32,num=$LIGHT_NUM$light_target$light_key"
  log "$1 r$2: (c) heavy and light tenants"
  bench "c_$1_r$2_mix" --tenants "$mix" --seed "$((50 + $2))"
  log "$1 r$2: (c) the light tenant alone"
  bench "c_$1_r$2_alone" --tenants "$mix" --tenants-only light --seed "$((50 + $2))"
}

tenants_key_file() {  # part c's tenants, the light one with its TTFT target
  printf 'heavy:sk-heavy\nlight:sk-light slo_ttft_ms=%s\n' "$LIGHT_TTFT_MS"
}

part_d() {  # part_d SERVER ROUND
  log "$1 r$2: (d) no targets, concurrency 32"
  bench "d_$1_r$2_c32" --dataset-name random --random-input-len 256 --random-output-len 128 \
    --num-prompts "$C32_PROMPTS" --max-concurrency 32 --seed "$((60 + $2))"
}

run_round() {  # run_round ROUND: every server in turn, the same order each round
  local round=$1
  if wants a || wants b || wants c || { wants d && [ -z "$BEFORE_KVSERVE" ]; }; then
    start_kvserve "kvserve_r$round" "$KVSERVE"
    for server in fcfs slo; do
      if wants a; then part_a "$server" "$round"; fi
      if wants b; then part_b "$server" "$round"; fi
    done
    if wants c; then part_c fcfs "$round"; fi
    if wants d && [ -z "$BEFORE_KVSERVE" ]; then part_d before "$round"; fi
    cleanup
  fi
  if wants d; then
    if [ -n "$BEFORE_KVSERVE" ]; then
      start_kvserve "before_r$round" "$BEFORE_KVSERVE"
      part_d before "$round"
      cleanup
    fi
    start_kvserve "after_r$round" "$KVSERVE" --slo-admission reject
    part_d after "$round"
    cleanup
  fi
  if wants c; then
    tenants_key_file >"$OUT_DIR/tenants.keys"
    start_kvserve "fairslo_r$round" "$KVSERVE" --scheduling-policy fair \
      --api-key-file "$OUT_DIR/tenants.keys"
    part_c fairslo "$round"
    cleanup
  fi
  if [ -z "$KVSERVE_ONLY" ]; then
    start_vllm "vllm_r$round"
    if wants a; then part_a vllm "$round"; fi
    if wants b; then part_b vllm "$round"; fi
    if wants c; then part_c vllm "$round"; fi
    cleanup
  fi
  "$PYTHON" "$ROOT/bench/slo_sitting/summarize.py" "$OUT_DIR" >"$OUT_DIR/summary.md"
}

mkdir -p "$OUT_DIR"
log "results in $OUT_DIR (rounds: $ROUNDS, parts: $PARTS)"
if [ -z "$KVSERVE_ONLY" ] && ! [ -x "$VCPU_VENV/bin/vllm" ]; then
  log "no vLLM-CPU in $VCPU_VENV: run bench/run_vllm_cpu.sh once (it installs it), or KVSERVE_ONLY=1"
  exit 1
fi
if ! [ -f "$VCPU_MODEL/config.json" ]; then
  log "exporting the default model to $VCPU_MODEL"
  (cd "$ROOT" && "$PYTHON" bench/vllm_cpu/export_model.py "$VCPU_MODEL")
fi
if [ -n "$CALIBRATE" ] || [ -z "${SHORT_TTFT_MS:-}" ] || [ -z "${SHORT_TPOT_MS:-}" ]; then
  calibrate
  # The environment's targets win over the calibrated ones.
  SHORT_TTFT_MS="${SHORT_TTFT_MS:-$CALIBRATED_TTFT_MS}"
  SHORT_TPOT_MS="${SHORT_TPOT_MS:-$CALIBRATED_TPOT_MS}"
fi
LIGHT_TTFT_MS="${LIGHT_TTFT_MS:-$SHORT_TTFT_MS}"  # (c): the light tenant's TTFT target
printf 'SHORT_TTFT_MS=%s\nSHORT_TPOT_MS=%s\nLIGHT_TTFT_MS=%s\nRATE=%s\nDURATION=%s\n' \
  "$SHORT_TTFT_MS" "$SHORT_TPOT_MS" "$LIGHT_TTFT_MS" "$RATE" "$DURATION" >"$OUT_DIR/targets.env"
log "short-class targets: TTFT $SHORT_TTFT_MS ms, TPOT $SHORT_TPOT_MS ms; light (c): TTFT $LIGHT_TTFT_MS ms"
for round in $(seq 1 "$ROUNDS"); do
  run_round "$round"
done
cat "$OUT_DIR/summary.md"
