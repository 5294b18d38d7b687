#!/usr/bin/env bash
# An EAGLE-1 head for the default model (SmolLM2-135M-Instruct), trained on this CPU.
#
# Self-distillation on the same data as train_medusa.sh: kvserve generates greedy replies
# (float32) to the 200 prompts of bench/spec_decode/train_prompts.jsonl and HF transformers
# gives the final hidden states f. One Llama decoder layer learns, from the pair
# (f_p, x_{p+1}), the next feature f_{p+1} (smooth L1) and the target's next-token
# distribution through the frozen LM head. A tenth of the prompts is held out; the command
# drafts 4-token chains autoregressively on them (the draft's own features after the first
# step), prints the per-depth acceptance and the expected mean acceptance length, and writes
# them to $OUT_DIR/train_report.json beside the head (published EAGLE-1 layout).
#
#   bash bench/spec_decode/train_eagle.sh             # OUT_DIR=~/.cache/kvserve/drafts/smollm2-eagle
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT_DIR="${OUT_DIR:-$HOME/.cache/kvserve/drafts/smollm2-eagle}"

exec nice -n 10 "$ROOT/.venv/bin/kvserve" train-draft \
  --method eagle --num-spec-tokens 4 \
  --num-prompts 200 --max-tokens 96 --epochs 6 --lr 1e-3 --batch-size 2 --seed 0 \
  --output "$OUT_DIR"
