#!/usr/bin/env bash
# The GPU checks, as one prepared script for a lent GPU machine (about 7 minutes on an H200).
#
# That machine has torch, Triton and transformers but no package index, and a call carries at
# most 64 MiB: the default model's GGUF (98 MB) travels in two halves, over two calls made
# back to back while the machine is warm (files outside $OUT stay on a warm machine).
#
#   here, once:   bash bench/gpu_check.sh --prepare      # wheels + model halves into .gpu/
#   device call 1 (carry [".gpu/a"]):                     bash bench/gpu_check.sh --stage
#   device call 2 (carry [".gpu/b", ".gpu/whl"]):         bash bench/gpu_check.sh
#
# The check: install the carried wheels; the kernel tests on the GPU (compiled Triton, not the
# interpreter); greedy float32 on the default model equal to HF's; the same greedy tokens
# with CUDA graphs as with --enforce-eager, and the decode step time of both; decode attention timed
# against the measured copy bandwidth and the H200's 4.8 TB/s (target: >= 70%). It prints one
# summary; the JSON lines also land in $OUT/gpu_check.jsonl.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
STAGE=/tmp/kvserve-gpu
OUT="${OUT:-/tmp/kvserve-gpu-out}"
mkdir -p "$STAGE" "$OUT"
PEAK_GBPS="${PEAK_GBPS:-4800}"

# Packages kvserve needs that the GPU image lacks (python 3.12, manylinux x86_64 wheels).
WHEELS="xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection msgspec pyzmq starlette uvicorn h11 anyio sniffio gguf jsonschema jsonschema-specifications referencing rpds-py psutil prometheus-client"

if [ "${1:-}" = "--prepare" ]; then
  rm -rf .gpu && mkdir -p .gpu/a .gpu/b .gpu/whl
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
  for name in $WHEELS; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .gpu/whl "$name" || echo "no wheel for $name" >&2
  done
  gguf=$(.venv/bin/python -c 'from kvserve.services.worker.model_loader import default_gguf_path as p; print(p())')
  half=$(( $(stat -c %s "$gguf") / 2 + 1 ))
  split -b "$half" -d -a 1 "$gguf" .gpu/part
  mv .gpu/part0 .gpu/a/ && mv .gpu/part1 .gpu/b/
  du -sh .gpu/a .gpu/b .gpu/whl
  exit 0
fi

if [ "${1:-}" = "--stage" ]; then  # call 1: keep the first half on the warm machine
  cp .gpu/a/part0 "$STAGE/" && echo "staged $(du -h "$STAGE/part0" | cut -f1)"
  exit 0
fi

log() { echo "== $*"; }
summary=()
record() { summary+=("$1: $2"); }

log "installing the carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .gpu/whl/*.whl >/dev/null
# kvserve installs from several folders (pyproject's [tool.setuptools.package-dir]: shared/ as
# kvserve.shared, ...). Links under kvserve/ import it in place without installing, whichever
# of the repository root or PYTHONPATH comes first on sys.path; they go again on exit.
links=$(python3 - "$ROOT" <<'EOF'
import sys, tomllib
from pathlib import Path
root = Path(sys.argv[1])
dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
for name, folder in dirs.items():
    if name.startswith("kvserve.") and not (root / "kvserve" / name.split(".", 1)[1]).exists():
        (root / "kvserve" / name.split(".", 1)[1]).symlink_to(root / folder)
        print(root / "kvserve" / name.split(".", 1)[1])
EOF
)
trap 'rm -f $links' EXIT
# Not the root itself on the path: its kernels/ would shadow PyPI's `kernels` for transformers.
mkdir -p /tmp/kvserve-path && ln -sfn "$ROOT/kvserve" /tmp/kvserve-path/kvserve
export PYTHONPATH="/tmp/site:/tmp/kvserve-path"
python3 - <<'EOF' || { echo "kvserve does not import"; exit 1; }
import torch, kvserve, kvserve.kernels  # noqa
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name())
EOF

# CHECKS picks some of them for a rerun (the device time is short): e.g. CHECKS="greedy".
CHECKS="${CHECKS:-kernels greedy graphs attention}"
wants() { [[ " $CHECKS " == *" $1 "* ]]; }

log "kernel tests on the GPU"
if ! wants kernels; then
  record "kernel tests" "SKIPPED: not in CHECKS"
elif timeout 240 python3 -m pytest -q -x tests/kernels -p no:cacheprovider >"$OUT/kernel_tests.txt" 2>&1; then
  record "kernel tests" "$(tail -1 "$OUT/kernel_tests.txt")"
else
  record "kernel tests" "FAILED: $(tail -1 "$OUT/kernel_tests.txt")"
fi

log "greedy float32 vs HF on the default model"
MODEL="$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -f "$STAGE/part0" ] && [ -f .gpu/b/part1 ]; then
  cat "$STAGE/part0" .gpu/b/part1 >"$MODEL"
fi
if ! wants greedy; then
  record "greedy vs HF" "SKIPPED: not in CHECKS"
elif [ -f "$MODEL" ]; then
  KVSERVE_CACHE_DIR="$STAGE/cache" timeout 240 python3 bench/gpu_check.py greedy --model "$MODEL" \
    >>"$OUT/gpu_check.jsonl" 2>"$OUT/greedy.log"
  record "greedy vs HF" "$(tail -1 "$OUT/gpu_check.jsonl")"
else
  record "greedy vs HF" "SKIPPED: the model's halves were not both here (--stage first)"
fi

log "CUDA graphs against --enforce-eager on the default model"
if ! wants graphs; then
  record "cuda graphs" "SKIPPED: not in CHECKS"
elif [ -f "$MODEL" ]; then
  KVSERVE_CACHE_DIR="$STAGE/cache" timeout 300 python3 bench/gpu_check.py cuda_graphs \
    --model "$MODEL" >"$OUT/cuda_graphs.jsonl" 2>"$OUT/cuda_graphs.log"
  cat "$OUT/cuda_graphs.jsonl" >>"$OUT/gpu_check.jsonl"
  record "cuda graphs" "$(python3 -c 'import json, sys; print(json.loads(sys.stdin.readlines()[-1])["summary"])' \
    <"$OUT/cuda_graphs.jsonl" 2>/dev/null || echo "FAILED: $(tail -3 "$OUT/cuda_graphs.log")")"
else
  record "cuda graphs" "SKIPPED: the model's halves were not both here (--stage first)"
fi

log "decode attention against HBM bandwidth"
if wants attention; then
  timeout 120 python3 bench/gpu_check.py attention --peak-gbps "$PEAK_GBPS" \
    >>"$OUT/gpu_check.jsonl" 2>"$OUT/attention.log"
  record "attention" "$(grep decode_attention "$OUT/gpu_check.jsonl" | tr '\n' ' ')"
else
  record "attention" "SKIPPED: not in CHECKS"
fi

echo
echo "==================== GPU check summary ===================="
for line in "${summary[@]}"; do echo "$line"; done
