#!/usr/bin/env bash
# Issue 30's serving figures, interleaved in one sitting (bench/run_vllm_cpu.sh per variant):
# per round, bfloat16 everywhere,
#   kvserve and vLLM-CPU serving the W8A8 checkpoint (W8A8, llm-compressor's output),
#   kvserve serving the float model it was quantized from,
#   kvserve serving the float model with --kv-cache-dtype fp8;
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
export DTYPES=bfloat16 ROUNDS=1 WORKLOADS="throughput c32"

for round in $(seq "$first_round" "$rounds"); do
  OUT_DIR="$OUT_DIR/w8a8_r$round" VCPU_MODEL="$W8A8" bash "$ROOT/bench/run_vllm_cpu.sh"
  OUT_DIR="$OUT_DIR/bf16_r$round" VCPU_MODEL="$FLOAT" KVSERVE_ONLY=1 \
    bash "$ROOT/bench/run_vllm_cpu.sh"
  OUT_DIR="$OUT_DIR/fp8kv_r$round" VCPU_MODEL="$FLOAT" KVSERVE_ONLY=1 \
    KVSERVE_ARGS="--kv-cache-dtype fp8" bash "$ROOT/bench/run_vllm_cpu.sh"
done
"$ROOT/.venv/bin/python" - "$OUT_DIR" "$OUTPUT_LEN" <<'PY'
import glob, json, os, statistics, sys

out, output_len = sys.argv[1], int(sys.argv[2])
rows: dict[str, dict[str, list[float]]] = {}
for path in sorted(glob.glob(os.path.join(out, "*_r*", "*.json"))):
    variant = os.path.basename(os.path.dirname(path)).rsplit("_r", 1)[0]
    name = os.path.basename(path)
    system = "vllm" if name.startswith("vllm") else "kvserve"
    workload = "c32" if name.endswith("_c32.json") else "offline"
    data = json.load(open(path))
    # bench serve: output_throughput; bench throughput (both systems): requests/s x OUTPUT_LEN
    tok_s = data.get("output_throughput") or data["requests_per_second"] * output_len
    rows.setdefault(f"{system} {variant} {workload}", {}).setdefault("tok_s", []).append(tok_s)
for key, value in sorted(rows.items()):
    per_round = ", ".join(f"{v:.1f}" for v in value["tok_s"])
    print(f"{key:28s} output tok/s per round: {per_round}; median {statistics.median(value['tok_s']):.1f}")
PY
