#!/usr/bin/env bash
# Medusa heads for the default model (SmolLM2-135M-Instruct), trained on this CPU.
#
# Self-distillation: kvserve generates greedy replies (float32) to the 200 prompts of
# bench/spec_decode/train_prompts.jsonl, HF transformers gives the final hidden states, and
# 3 heads of 1 residual layer each, sharing the target's LM head, learn the model's own
# tokens 2, 3 and 4 places ahead. A tenth of the prompts is held out; the command prints each
# head's held-out top-1 accuracy and the expected mean acceptance length of greedy chain
# drafting, and writes them to $OUT_DIR/train_report.json beside the heads.
#
#   bash bench/spec_decode/train_medusa.sh            # OUT_DIR=~/.cache/kvserve/drafts/smollm2-medusa
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT_DIR="${OUT_DIR:-$HOME/.cache/kvserve/drafts/smollm2-medusa}"

exec nice -n 10 "$ROOT/.venv/bin/kvserve" train-draft \
  --method medusa --num-heads 3 --num-layers 1 --share-lm-head \
  --num-prompts 200 --max-tokens 96 --epochs 2 --lr 1e-3 --batch-size 64 --seed 0 \
  --output "$OUT_DIR"
