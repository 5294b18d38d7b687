#!/usr/bin/env bash
# Batch-1 TPOT of kvserve and llama.cpp's llama-server on the same GGUF, interleaved.
#
#   bash bench/llama_cpp_tpot.sh                      # the default model's GGUF (Q4_1)
#   GGUF=/path/to/file.gguf ROUNDS=5 bash bench/llama_cpp_tpot.sh
#
# llama-server is built from the sources bundled in PyPI's llama-cpp-python sdist (cmake,
# GGML_NATIVE, Release) into LLAMA_CPP_DIR, once. Each round runs llama-server, then kvserve
# with the weights held quantized (`--quantization gguf`) and then kvserve on the float32
# expansion, each on both cores, with `kvserve bench serve` as the client of all three:
# NUM_PROMPTS random prompts, INPUT_LEN in / OUTPUT_LEN out, ignore_eos, max-concurrency 1.
# The summary prints each server's median mean-TPOT and the median of the per-round ratios.
# Not part of CI: the llama.cpp build takes about 10 minutes on 2 cores.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
KVSERVE="$ROOT/.venv/bin/kvserve"
PYTHON="$ROOT/.venv/bin/python"
LLAMA_CPP_VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
LLAMA_CPP_DIR="${LLAMA_CPP_DIR:-/tmp/kvserve-llama-cpp}"
GGUF="${GGUF:-$("$PYTHON" -c 'from kvserve.services.worker.model_loader import default_gguf_path as p; print(p())')}"
ROUNDS="${ROUNDS:-3}"
NUM_PROMPTS="${NUM_PROMPTS:-6}"
INPUT_LEN="${INPUT_LEN:-128}"
OUTPUT_LEN="${OUTPUT_LEN:-128}"
PORT="${PORT:-8013}"
OUT_DIR="${OUT_DIR:-$ROOT/bench/results/llama_cpp-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT_DIR"

source "$(dirname "$0")/sitting_server.sh"

build_llama_server() {
  local src="$LLAMA_CPP_DIR/llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp"
  LLAMA_SERVER="$src/build/bin/llama-server"
  [ -x "$LLAMA_SERVER" ] && return
  log "building llama-server $LLAMA_CPP_VERSION in $LLAMA_CPP_DIR (about 10 minutes)"
  mkdir -p "$LLAMA_CPP_DIR"
  (cd "$LLAMA_CPP_DIR" &&
    "$ROOT/.venv/bin/pip" download -q --no-deps --no-binary :all: \
      "llama-cpp-python==$LLAMA_CPP_VERSION" -d . &&
    tar xzf "llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz")
  (cd "$src" &&
    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null &&
    cmake --build build -j"$(nproc)" --target llama-server >/dev/null)
}

bench_one() {  # bench_one NAME ROUND
  "$KVSERVE" bench serve --port "$PORT" --endpoint /v1/completions \
    --dataset-name random --num-prompts "$NUM_PROMPTS" --random-input-len "$INPUT_LEN" \
    --random-output-len "$OUTPUT_LEN" --ignore-eos --max-concurrency 1 --seed "$2" \
    --disable-tqdm --save-result --result-dir "$OUT_DIR" --result-filename "$1-$2.json" \
    --label "$1" >"$OUT_DIR/$1-$2.txt"
}

run_llama() {  # run_llama ROUND
  "$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$PORT" -t "$(nproc)" -np 1 -c 4096 \
    >"$OUT_DIR/llama.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy "$OUT_DIR/llama.log"
  bench_one llama "$1"
  cleanup
}

run_kvserve() {  # run_kvserve NAME ROUND [serve flags]
  local name=$1 round=$2
  shift 2
  "$KVSERVE" serve --model "$GGUF" --port "$PORT" --dtype float32 "$@" \
    >"$OUT_DIR/$name.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy "$OUT_DIR/$name.log"
  bench_one "$name" "$round"
  cleanup
}

build_llama_server
log "GGUF $GGUF; results in $OUT_DIR"
for round in $(seq "$ROUNDS"); do
  log "round $round"
  run_llama "$round"
  run_kvserve kvserve_gguf "$round" --quantization gguf
  run_kvserve kvserve_f32 "$round"
done

"$PYTHON" - "$OUT_DIR" "$ROUNDS" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
tpot = {
    name: [json.load(open(f"{out}/{name}-{r}.json"))["mean_tpot_ms"] for r in range(1, rounds + 1)]
    for name in ("llama", "kvserve_gguf", "kvserve_f32")
}
for name, values in tpot.items():
    print(f"{name:13s} mean TPOT ms, median of {rounds}: {statistics.median(values):7.2f}  {values}")
for name in ("kvserve_gguf", "kvserve_f32"):
    ratios = [k / l for k, l in zip(tpot[name], tpot["llama"])]
    print(f"{name} / llama TPOT: median {statistics.median(ratios):.2f}x "
          f"(range {min(ratios):.2f}-{max(ratios):.2f})")
EOF
