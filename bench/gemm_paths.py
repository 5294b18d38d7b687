"""The CPU GEMM paths of kernels/gemm.py on the default model's layer shapes, interleaved.

For each linear-layer shape of SmolLM2-135M (and its LM head) and each row count, times
torch's F.linear and oneDNN's packed path A B A B in one process, and prints GFLOP/s and
the ratio, next to what `kernels.gemm.measure_shape` (the start-up tuner) picks.

    .venv/bin/python bench/gemm_paths.py [--dtype float32 bfloat16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kvserve.kernels import gemm

# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536, vocab 49152.
SHAPES = {
    "qkv": (960, 576),
    "o_proj": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
ROWS = (1, 4, 16, 64, 256, 1024)


def _seconds(fn, min_s: float = 0.05) -> float:
    fn()
    samples, deadline = [], time.perf_counter() + min_s
    while len(samples) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples)  # load only adds time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        "| dtype | layer | N x K | rows | torch GFLOP/s | oneDNN GFLOP/s | oneDNN / torch | tuner |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for layer, (n, k) in SHAPES.items():
            weight = torch.randn(n, k, dtype=dtype) / k**0.5
            packed = gemm.pack_onednn(weight)
            tuned = gemm.measure_shape(dtype, n, k, max_rows=max(ROWS))
            for rung, rows in enumerate(ROWS):
                if layer == "lm_head" and rows > 256:
                    continue  # logits only for the sampled rows (<= max_num_seqs)
                x = torch.randn(rows, k, dtype=dtype)
                a, b = [], []
                for _ in range(args.rounds):
                    a.append(_seconds(lambda x=x, w=weight: F.linear(x, w)))
                    b.append(_seconds(lambda x=x, p=packed: gemm.onednn_linear(x, p, None)))
                flop = 2 * rows * n * k
                ta, tb = min(a), min(b)
                print(
                    f"| {dtype_name} | {layer} | {n}x{k} | {rows} | {flop / ta / 1e9:.0f} | "
                    f"{flop / tb / 1e9:.0f} | {ta / tb:.2f} | {tuned.paths[rung]} |"
                )


if __name__ == "__main__":
    main()
